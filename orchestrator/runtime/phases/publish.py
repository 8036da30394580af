"""Phase 11: the master points ``checkpoints/current.json`` at the new checkpoint, and copies
the update's off-policy figures (rl.is_correction) from its ``train_stats.json`` into the
iteration's summary, where `status` and the report read them."""

from __future__ import annotations

import json

from orchestrator.data import summary
from orchestrator.protocol import fsio
from orchestrator.runtime.context import PhaseContext


def publish_checkpoint(ctx: PhaseContext) -> None:
    final = ctx.layout.checkpoint(ctx.iteration)
    if not final.is_dir():
        raise FileNotFoundError(f"checkpoint {final} of iteration {ctx.iteration} is missing; training did not finish")
    rel = str(final.relative_to(ctx.layout.root))
    fsio.write_record(ctx.layout.current_checkpoint, {"iteration": ctx.iteration, "path": rel})
    summary.update(ctx.layout, ctx.iteration, checkpoint=rel, **_importance(final / "train_stats.json"))


def _importance(stats_path) -> dict:
    """``{"is_ratio": {correction, mean, max, capped_fraction}}`` when the update corrected
    with the engine's log-probs; else nothing."""
    try:
        stats = json.loads(stats_path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stats, dict) or stats.get("is_correction") in (None, "none"):
        return {}
    return {"is_ratio": {"correction": stats["is_correction"], "mean": stats.get("is_ratio_mean"),
                         "max": stats.get("is_ratio_max"), "capped_fraction": stats.get("is_capped_fraction")}}
