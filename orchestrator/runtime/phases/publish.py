"""Phase 11: the master points ``checkpoints/current.json`` at the new checkpoint."""

from __future__ import annotations

from orchestrator.data import summary
from orchestrator.protocol import fsio
from orchestrator.runtime.context import PhaseContext


def publish_checkpoint(ctx: PhaseContext) -> None:
    final = ctx.layout.checkpoint(ctx.iteration)
    if not final.is_dir():
        raise FileNotFoundError(f"checkpoint {final} of iteration {ctx.iteration} is missing; training did not finish")
    rel = str(final.relative_to(ctx.layout.root))
    fsio.write_record(ctx.layout.current_checkpoint, {"iteration": ctx.iteration, "path": rel})
    summary.update(ctx.layout, ctx.iteration, checkpoint=rel)
