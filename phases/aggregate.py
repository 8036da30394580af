"""Phases 3-4: the master checks every rank's seal, then streams the shards into the
iteration's aggregate, verifying each against its manifest and that every planned task is
there exactly once."""

from __future__ import annotations

from orchestrator import shards, summary
from orchestrator.context import PhaseContext


def _sources(ctx: PhaseContext, split: str) -> list[tuple[str, object]]:
    per_rank = ctx.plan[split]["per_rank"]
    return [(f"rank {r}", ctx.it.shard(split, r)) for r in range(len(per_rank)) if per_rank[r] > 0]


def verify_seals(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    if not ctx.plan["train"]["enabled"]:
        return {}
    counts = {}
    for label, shard in _sources(ctx, "train"):
        m = shards.sealed(shard)
        if m is None:
            raise shards.ShardError(f"{label}: shard {shard} is missing or does not match its manifest")
        counts[label] = m.count
    return {"sealed": counts}


def merge_split(ctx: PhaseContext, split: str) -> shards.Manifest:
    """The split's aggregate: reused if sealed, else merged and checked against the plan."""
    dest = ctx.it.aggregate(split)
    existing = shards.sealed(dest)
    if existing is not None and not existing.extra.get("partial"):
        return existing  # a salvaged partial one is replaced by the full merge
    planned = ctx.workload.task_ids(split, ctx.iteration)[: ctx.plan[split]["total"]]
    m = shards.merge(_sources(ctx, split), dest, split=split, iteration=ctx.iteration, partial=False)
    if m.count != len(planned):
        shards.manifest_path(dest).unlink()
        dest.unlink()
        raise shards.ShardError(
            f"{split} aggregate of iteration {ctx.iteration} has {m.count} trajectories but the plan has {len(planned)} tasks"
        )
    return m


def merge_train_shards(ctx: PhaseContext) -> None:
    if not ctx.plan["train"]["enabled"]:
        return
    m = merge_split(ctx, "train")
    trajectories = m.extra.get("trajectories", m.count)
    summary.update(ctx.layout, ctx.iteration, trajectories=trajectories)
    ctx.log.info("aggregated %d train trajectories (%d tasks) of iteration %d", trajectories, m.count, ctx.iteration)
