"""Phases 1-2: each rank rolls out its weighted share into its own shard, then seals it.

The shard is appended in small fsynced batches; a restarted rank keeps what its shard
already holds and generates only the missing tasks. A sealed shard is never regenerated.
"""

from __future__ import annotations

from orchestrator import terminal
from orchestrator.data import shards
from orchestrator.protocol import fsio
from orchestrator.runtime.context import PhaseContext


def generate_shard(ctx: PhaseContext, split: str) -> None:
    path = ctx.it.shard(split, ctx.rank)
    offset, count = ctx.share(split)
    if shards.sealed(path) is not None:
        ctx.log.info("%s shard of iteration %d is sealed already: reusing it", split, ctx.iteration)
        ctx.progress(count, count)
        return
    mine = ctx.workload.task_ids(split, ctx.iteration)[offset : offset + count]
    with shards.ShardWriter(path) as writer:
        todo = [t for t in mine if t not in writer.task_ids]
        done = count - len(todo)
        if done:
            ctx.log.info("resuming %s shard: %d of %d tasks already there", split, done, count)
        ctx.progress(done, count)
        with terminal.progress(f"iteration {ctx.iteration} {split} rollout", count, done) as bar:
            for batch in ctx.workload.rollout(ctx, split, todo):
                for record in batch:
                    writer.append(record)
                writer.flush()  # each batch is durable before it is counted: progress shown is progress kept
                done += len(batch)
                ctx.progress(done, count)
                bar.update(done)


def seal_shard(ctx: PhaseContext, split: str) -> dict:
    shard = ctx.it.shard(split, ctx.rank)
    m = fsio.retry_transient(lambda: shards.seal(shard, rank=ctx.rank, split=split, iteration=ctx.iteration), f"sealing {shard}")
    return {"split": split, "count": m.count, "sha256": m.sha256}


def generate_train_shard(ctx: PhaseContext) -> None:
    if ctx.plan["train"]["enabled"]:
        generate_shard(ctx, "train")


def seal_train_shard(ctx: PhaseContext) -> dict | None:
    if ctx.plan["train"]["enabled"]:
        return seal_shard(ctx, "train")
    return None
