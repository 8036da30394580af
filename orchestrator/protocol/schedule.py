"""Where a run stands: the next phase after the last released barrier, the phases left to
walk, and whether none is left (pure; the runner walks them, and a worker that wakes to a
finished run ends at once instead of waiting for a master that will not come)."""

from __future__ import annotations

from typing import Iterator

from orchestrator.phase_table import Phase, RLPhase
from orchestrator.protocol.schema import Progress


def next_point(progress: Progress | None) -> tuple[int, Phase]:
    """The first phase after the last released barrier."""
    if progress is None:
        return 1, Phase.SYNC_START
    if progress.phase is Phase.SYNC_END:
        return progress.iteration + 1, Phase.SYNC_START
    return progress.iteration, Phase(progress.phase + 1)


def schedule(start: tuple[int, Phase], rl_phase: RLPhase, max_iterations: int | None) -> Iterator[tuple[int, Phase]]:
    """(iteration, phase) pairs to walk from ``start``, skipping phases ``rl_phase`` excludes."""
    iteration, phase = start
    while max_iterations is None or iteration <= max_iterations:
        for p in Phase:
            if p >= phase and rl_phase.includes(p):
                yield iteration, p
        iteration, phase = iteration + 1, Phase.SYNC_START


def first_point(start: tuple[int, Phase], rl_phase: RLPhase, max_iterations: int | None) -> tuple[int, Phase] | None:
    return next(schedule(start, rl_phase, max_iterations), None)


def finished(progress: Progress | None, rl_phase: RLPhase, max_iterations: int | None) -> bool:
    """Whether a run at ``progress`` has nothing left to walk under this configuration."""
    return first_point(next_point(progress), rl_phase, max_iterations) is None
