"""Fault hooks for tests, set through one environment variable.

``ORCHESTRATOR_FAULT`` holds ``ACTION@ITERATION:PHASE``, for example ``hold@2:10``:

- ``hold``: at the start of that phase, report state ``held`` in the heartbeat and wait
  (cancellably, at most ``HOLD_LIMIT_S``) so a test can ``kill -9`` or SIGINT the rank at a
  known point.
- ``hold-after-arrive``: the same, right after writing the arrival at that phase's barrier.
- ``hold-in-removal``: the same, inside the master's checkpoint removal in that phase (13),
  after the checkpoint was renamed aside and before it is deleted (checkpoints/retention.py).
- ``hold-before-steal``: the same, inside a rank's first steal of a chunk in that phase (1 or
  6), once the chunk is listed in its ``stolen.r<R>.json`` and before its claim is created.
- ``hold-in-steal``: the same, inside a rank's first steal of a chunk in that phase (1 or 6),
  after its claim file was created and before it is written (data/claims.py).
- ``hold-after-steal``: the same, once that claim is written, before any of the chunk's records.
- ``hold-after-batch``: the same, once the rank's first batch of records in that phase (1 or
  6) is durable, before the rest: a rank caught part-way through its rollout.
- ``hold-after-round-batch``: the same, in a resample round of rl.filter_groups (phase 1): once
  the rank's first batch of that round's records is durable.
- ``hold-in-rebuild``: the same, inside a rank's rebuild of a version for its engines
  (publish.delta, checkpoints/node_copy.py) in that phase: built, not yet renamed into place.
- ``hold-in-delta`` (a train worker, phase 10): once the worker's part of the checkpoint is
  written (its weights a delta), before the stats and the final barrier: the checkpoint is
  still a staging directory.
- ``hold-in-replay`` (a train worker, phase 10): once the first iteration it replays is
  trained again (checkpoint.state_every), before the next.
- ``raise``: raise an exception inside that phase's work.

Each fires once per process: a rank that starts an attempt again (a master that takes its
workers back) passes the same point without stopping there again.

Unset in production; the hooks cost one dict lookup per phase.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "ORCHESTRATOR_FAULT"
HOLD_LIMIT_S = 300.0
ACTIONS = ("hold", "hold-after-arrive", "hold-in-removal", "hold-before-steal", "hold-in-steal", "hold-after-steal", "hold-after-batch",
           "hold-after-round-batch", "hold-in-rebuild", "hold-in-delta", "hold-in-replay", "raise")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Fault:
    action: str
    iteration: int
    phase: int

    def at(self, action: str, iteration: int, phase: int) -> bool:
        return (self.action, self.iteration, self.phase) == (action, iteration, phase)


def hold_in_child(action: str, iteration: int, phase: int, log) -> None:
    """In a process a rank started (a train worker): hold here, at most ``HOLD_LIMIT_S``, when
    ``ORCHESTRATOR_FAULT`` (inherited) names this point, saying so in its log."""
    fault = from_env()
    if fault is not None and fault.at(action, iteration, phase):
        import time

        log.warning("fault injection: holding at %s of iteration %d", action, iteration)
        time.sleep(HOLD_LIMIT_S)


def from_env(environ=os.environ) -> Fault | None:
    spec = environ.get(ENV)
    if not spec:
        return None
    action, _, where = spec.partition("@")
    iteration, _, phase = where.partition(":")
    if action not in ACTIONS or not (iteration.isdigit() and phase.isdigit()):
        raise ValueError(f"{ENV}={spec!r} is not ACTION@ITERATION:PHASE with ACTION one of {', '.join(ACTIONS)}")
    return Fault(action, int(iteration), int(phase))
