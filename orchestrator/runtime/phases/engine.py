"""Phases 7 and 12: the inference engine stops before training and restarts after it."""

from __future__ import annotations

from orchestrator.phase_table import RLPhase
from orchestrator.runtime.context import PhaseContext


def stop(ctx: PhaseContext) -> None:
    ctx.workload.engine_stop(ctx)


def restart(ctx: PhaseContext) -> None:
    """Restart only if this run goes on to roll out again."""
    cfg = ctx.config
    last = cfg.max_iterations is not None and ctx.iteration >= cfg.max_iterations
    if cfg.rl_phase is RLPhase.BOTH and not last:
        ctx.workload.engine_start(ctx)
