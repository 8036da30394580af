"""How far a trajectory's policy lags behind the update that trains on it (rl.max_staleness).

A record names the checkpoint its engine served (``policy_iteration``: the iteration that
made it, 0 for the base model). The update of iteration i starts from checkpoint i-1, so a
trajectory's staleness is i-1 - policy_iteration: 0 in lockstep, at most K with
rl.max_staleness=K (protocol/schedule.py walks the rollout of iteration i only once
checkpoint i-1-K is published). A staler one is a bug in that order, never dropped quietly.
"""

from __future__ import annotations

from orchestrator.errors import OrchestratorError


class StaleTrajectory(OrchestratorError):
    """An aggregate holds trajectories older than rl.max_staleness allows (a bug)."""


def oldest_allowed(iteration: int, max_staleness: int) -> int:
    """The oldest checkpoint whose trajectories the update of ``iteration`` may train on."""
    return max(0, iteration - 1 - max_staleness)


def staleness(iteration: int, policy_iteration: int) -> int:
    return iteration - 1 - policy_iteration


def check(iteration: int, max_staleness: int, policy_iterations: list[int] | None, what: str) -> None:
    """Refuse ``what`` (an aggregate) when its oldest trajectory (``policy_iterations``: the
    [oldest, newest] checkpoint iterations its records name) is past the bound, or when a
    record names a checkpoint the update of ``iteration`` cannot have had yet."""
    if not policy_iterations:
        return
    oldest, newest = policy_iterations
    bound = oldest_allowed(iteration, max_staleness)
    if oldest < bound:
        raise StaleTrajectory(
            f"{what} holds trajectories of checkpoint {oldest}, {staleness(iteration, oldest)} checkpoints behind the update "
            f"of iteration {iteration}, past rl.max_staleness={max_staleness} (the oldest allowed is checkpoint {bound}). "
            f"The run's order never rolls out so early: this is a bug, please report it with the run's log directory; "
            f"the iteration is not trained")
    if newest > iteration - 1:
        raise StaleTrajectory(
            f"{what} holds trajectories of checkpoint {newest}, but the update of iteration {iteration} starts from "
            f"checkpoint {iteration - 1}: this is a bug, please report it with the run's log directory")
