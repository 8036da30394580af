"""Where a run stands: the next phase after the last released barrier, the phases left to
walk, and whether none is left (pure; the runner walks them, and a worker that wakes to a
finished run ends at once instead of waiting for a master that will not come).

Every rank walks the same order of (iteration, phase) points, so one barrier at a time is
open. With rl.max_staleness=K >= 1 the order is pipelined: the update half of an iteration
is cut where training starts, and the rollout of a later iteration is walked while it
trains (the trainers are child processes; the rank waits for them at phase 11):

    K = 0:  R1 U1 R2 U2 R3 U3 ...                       (lockstep, 0-13 of each in turn)
    K >= 1: R1 L1 R2 .. R(1+K) | F1 L2 R(2+K) | F2 L3 R(3+K) | ...

``R(j)`` is phases 0-6 of iteration j (rollout, aggregate, eval), ``L(i)`` phases 7-10
(prepare; training launched), ``F(i)`` phases 11-13 (training awaited; checkpoint
published; engines moved to it; final sync). The rollout of iteration j is walked after
checkpoint j-1-K is published and never earlier, so its trajectories are at most K
checkpoints older than the update that trains on them (``data/staleness.py``).
"""

from __future__ import annotations

from typing import Iterator

from orchestrator.phase_table import Phase, RLPhase
from orchestrator.protocol.schema import Progress

ROLLOUT_HALF = tuple(p for p in Phase if p <= Phase.EVAL)
LAUNCH = (Phase.ENGINE_STOP, Phase.PREPARE, Phase.TRAIN_CONFIG, Phase.TRAIN)
FINISH = (Phase.PUBLISH, Phase.ENGINE_RESTART, Phase.SYNC_END)


def _pipelined(max_staleness: int) -> Iterator[tuple[int, Phase]]:
    """The unbounded pipelined order for K = ``max_staleness`` >= 1."""

    def half(iteration: int, phases: tuple[Phase, ...]) -> Iterator[tuple[int, Phase]]:
        return ((iteration, p) for p in phases)

    yield from half(1, ROLLOUT_HALF)
    yield from half(1, LAUNCH)
    for j in range(2, max_staleness + 2):
        yield from half(j, ROLLOUT_HALF)
    i = 1
    while True:
        yield from half(i, FINISH)
        yield from half(i + 1, LAUNCH)
        yield from half(i + 1 + max_staleness, ROLLOUT_HALF)
        i += 1


def next_point(progress: Progress | None, max_staleness: int = 0) -> tuple[int, Phase]:
    """The first phase after the last released barrier."""
    if progress is None:
        return 1, Phase.SYNC_START
    if max_staleness:
        order = _pipelined(max_staleness)
        for point in order:
            if point == (progress.iteration, progress.phase):
                return next(order)
    if progress.phase is Phase.SYNC_END:
        return progress.iteration + 1, Phase.SYNC_START
    return progress.iteration, Phase(progress.phase + 1)


def schedule(start: tuple[int, Phase], rl_phase: RLPhase, max_iterations: int | None,
             max_staleness: int = 0) -> Iterator[tuple[int, Phase]]:
    """(iteration, phase) pairs to walk from ``start``, skipping phases ``rl_phase`` excludes."""
    if max_staleness:
        yield from _pipelined_from(start, max_iterations, max_staleness)
        return
    iteration, phase = start
    while max_iterations is None or iteration <= max_iterations:
        for p in Phase:
            if p >= phase and rl_phase.includes(p):
                yield iteration, p
        iteration, phase = iteration + 1, Phase.SYNC_START


def _pipelined_from(start: tuple[int, Phase], max_iterations: int | None, max_staleness: int) -> Iterator[tuple[int, Phase]]:
    """The pipelined order from ``start`` on, without the iterations past ``max_iterations``."""
    started = False
    for iteration, phase in _pipelined(max_staleness):
        if max_iterations is not None and phase in FINISH and iteration > max_iterations:
            return  # every later point is of a later iteration still
        started = started or (iteration, phase) == start
        if started and (max_iterations is None or iteration <= max_iterations):
            yield iteration, phase


def first_point(start: tuple[int, Phase], rl_phase: RLPhase, max_iterations: int | None,
                max_staleness: int = 0) -> tuple[int, Phase] | None:
    return next(schedule(start, rl_phase, max_iterations, max_staleness), None)


def finished(progress: Progress | None, rl_phase: RLPhase, max_iterations: int | None) -> bool:
    """Whether a run at ``progress`` has nothing left to walk under this configuration (the
    order the run was walked in is the one its progress record names)."""
    k = progress.max_staleness if progress is not None else 0
    return first_point(next_point(progress, k), rl_phase, max_iterations, k) is None
