"""Phases 3-4: the master checks every rank's seal, then streams the shards into the
iteration's aggregate, verifying each against its manifest and that every planned task is
there exactly once."""

from __future__ import annotations

from orchestrator.data import shards, summary
from orchestrator.protocol import fsio
from orchestrator.protocol.waiting import Deadline, poll
from orchestrator.runtime.context import PhaseContext


def _sources(ctx: PhaseContext, split: str) -> list[tuple[str, object]]:
    per_rank = ctx.plan[split]["per_rank"]
    return [(f"rank {r}", ctx.it.shard(split, r)) for r in range(len(per_rank)) if per_rank[r] > 0]


def wait_for_seals(ctx: PhaseContext, split: str) -> dict[str, shards.Manifest]:
    """Every rank's seal of ``split``, as its arrival announced it. A manifest is a new file:
    on a network filesystem it can show up on the master's mount later than the arrival (a
    file it already knew), so wait for each, up to one node timeout."""
    timeout = ctx.config.coordination.node_timeout_s
    found = {}
    for label, shard in _sources(ctx, split):
        def seen(shard=shard):
            fsio.refresh_dir(shard.parent)
            return shards.sealed(shard)

        found[label] = poll(seen, deadline=Deadline.after(timeout, f"the seal of {shard}"), cancel=ctx.cancel,
                            backoff=ctx.coordinator.backoff,
                            on_timeout=lambda label=label, shard=shard: shards.ShardError(
                                f"{label}: shard {shard} is missing or does not match its manifest "
                                f"(waited coordination.node_timeout_s={timeout:g} s)"))
    return found


def verify_seals(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    if not ctx.plan["train"]["enabled"]:
        return {}
    return {"sealed": {label: m.count for label, m in wait_for_seals(ctx, "train").items()}}


def merge_split(ctx: PhaseContext, split: str) -> shards.Manifest:
    """The split's aggregate: reused if sealed, else merged and checked against the plan."""
    dest = ctx.it.aggregate(split)
    existing = shards.sealed(dest)
    if existing is not None and not existing.extra.get("partial"):
        return existing  # a salvaged partial one is replaced by the full merge
    planned = ctx.workload.task_ids(split, ctx.iteration)[: ctx.plan[split]["total"]]
    wait_for_seals(ctx, split)
    # A shard read cut short or stale (sshfs, NFS) fails its checksum: read it again before
    # calling it damaged.
    m = fsio.retry_transient(lambda: shards.merge(_sources(ctx, split), dest, split=split, iteration=ctx.iteration, partial=False),
                             f"merging the {split} shards of iteration {ctx.iteration}", transient=(shards.ShardError,))
    if m.count != len(planned):
        shards.manifest_path(dest).unlink()
        dest.unlink()
        raise shards.ShardError(
            f"{split} aggregate of iteration {ctx.iteration} has {m.count} trajectories but the plan has {len(planned)} tasks"
        )
    return m


def note_reward_errors(ctx: PhaseContext, split: str, m: shards.Manifest) -> None:
    """The split's failed reward calls (samples scored 0) into the iteration's summary."""
    count = m.extra.get("reward_errors") or 0
    if not count:
        return
    first = m.extra.get("first_reward_error") or {}
    done = (summary.read(ctx.layout, ctx.iteration) or {}).get("reward_errors") or {}
    entry = {"count": count, "samples": m.extra.get("trajectories"), "first_task_id": first.get("task_id"), "first_error": first.get("error")}
    summary.update(ctx.layout, ctx.iteration, reward_errors={**done, split: entry})
    ctx.log.warning("%d of %s %s samples of iteration %d scored 0 because rl.reward failed; first on task %s (see the "
                    "iteration's summary.json)", count, m.extra.get("trajectories"), split, ctx.iteration, first.get("task_id"))


def merge_train_shards(ctx: PhaseContext) -> None:
    if not ctx.plan["train"]["enabled"]:
        return
    m = merge_split(ctx, "train")
    trajectories = m.extra.get("trajectories", m.count)
    summary.update(ctx.layout, ctx.iteration, trajectories=trajectories)
    note_reward_errors(ctx, "train", m)
    ctx.log.info("aggregated %d train trajectories (%d tasks) of iteration %d", trajectories, m.count, ctx.iteration)
