"""Phase 11: the master points ``checkpoints/current.json`` at the new checkpoint, and copies
the update's figures from its ``train_stats.json`` into the iteration's summary, where
`status`, the report and experiment tracking read them (a checkpoint may be pruned later;
the summary stays): ``update`` (the step means of the loss, KL, entropy, clipping and
gradient norm, the reward, lengths and groups) and ``is_ratio`` (rl.is_correction)."""

from __future__ import annotations

import json

from orchestrator.checkpoints import store
from orchestrator.data import summary
from orchestrator.runtime import decisions
from orchestrator.runtime.context import PhaseContext


def publish_checkpoint(ctx: PhaseContext) -> None:
    """Master: point the current pointer at the iteration's checkpoint (its work in lockstep)."""
    final = store.publish(ctx.layout, ctx.iteration).path
    rel = str(final.relative_to(ctx.layout.root))
    stats = _stats(final / "train_stats.json")
    summary.update(ctx.layout, ctx.iteration, checkpoint=rel, **_update_figures(stats), **_importance(stats))


def publish_as_decision(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    """rl.max_staleness >= 1: every rank's training is done once all arrived; the master
    publishes then, as the phase's decision."""
    publish_checkpoint(ctx)
    return announce(ctx, arrivals)


def announce(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    """Phase 11's decision: the checkpoint the master published, which every rank's engines move to."""
    return {decisions.PUBLISHED: {"iteration": ctx.iteration, "path": str(ctx.layout.checkpoint(ctx.iteration).relative_to(ctx.layout.root))}}


def _stats(path) -> dict:
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _mean(values) -> float | None:
    numbers = [v for v in values or () if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(numbers) / len(numbers) if numbers else None


def _update_figures(stats: dict) -> dict:
    """``{"update": {...}}``: the update's means over its optimizer steps and its counts; nothing
    when the checkpoint has no stats (the rehearsal's)."""
    if "samples" not in stats:
        return {}
    figures = {key: _mean(stats.get(key)) for key in ("loss", "kl", "entropy", "clip_fraction", "grad_norm")}
    samples, sampled = stats["samples"], stats.get("sampled_tokens")
    trained, tokens = stats.get("trained_samples", samples), stats.get("completion_tokens")
    length = sampled / samples if sampled and samples else tokens / trained if tokens and trained else None
    figures |= {"mean_reward": stats.get("mean_reward"), "samples": samples, "records": stats.get("records"),
                "completion_tokens": tokens, "response_length": length,
                "zero_advantage_groups": stats.get("zero_advantage_groups"), "seconds": stats.get("seconds")}
    figures |= {key: stats[key] for key in ("filtered_groups", "overlong_samples", "replayed", "published", "distill_reverse_kl")
                if key in stats}
    return {"update": figures}


def _importance(stats: dict) -> dict:
    """``{"is_ratio": {correction, mean, max, capped_fraction}}`` when the update corrected
    with the engine's log-probs; else nothing."""
    if stats.get("is_correction") in (None, "none"):
        return {}
    return {"is_ratio": {"correction": stats["is_correction"], "mean": stats.get("is_ratio_mean"),
                         "max": stats.get("is_ratio_max"), "capped_fraction": stats.get("is_capped_fraction")}}
