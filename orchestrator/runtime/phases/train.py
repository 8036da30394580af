"""Phase 10: every rank trains; the node of train worker 0 (the master unless the placement
says otherwise) makes a staging directory, where the checkpoint is written (by worker 0, or
by every worker its shard with train.strategy=fsdp), seals it and renames it into place, so a
checkpoint directory is either complete or absent."""

from __future__ import annotations

from orchestrator.checkpoints import store
from orchestrator.protocol import fsio
from orchestrator.protocol.waiting import Deadline, poll
from orchestrator.runtime.context import PhaseContext


def _train_config(ctx: PhaseContext) -> dict:
    fsio.refresh_dir(ctx.it.root)
    return poll(
        lambda: fsio.read_record(ctx.it.train_config),
        deadline=Deadline.after(ctx.config.coordination.node_timeout_s, f"{ctx.it.train_config}"),
        cancel=ctx.cancel,
        backoff=ctx.run.backoff,
    )


def train(ctx: PhaseContext) -> None:
    cfg = _train_config(ctx)
    if store.exists(ctx.layout, ctx.iteration):
        ctx.log.info("checkpoint of iteration %d exists already: not training again", ctx.iteration)
        if ctx.rank == ctx.run.placement.checkpoint_node:
            _remove_stagings(ctx)
        return
    if ctx.rank != ctx.run.placement.checkpoint_node:
        ctx.workload.train(ctx, cfg, None)
        return
    staging = store.new_staging(ctx.layout, ctx.iteration, ctx.attempt_id, ctx.run.train_round)
    ctx.workload.train(ctx, cfg, staging)
    store.place(ctx.layout, ctx.iteration, staging)
    _remove_stagings(ctx)


def _remove_stagings(ctx: PhaseContext) -> None:
    left = store.remove_stagings(ctx.layout, ctx.iteration)
    if left:
        ctx.log.info("removed %d staging director%s of earlier tries of iteration %d: %s", len(left), "y" if len(left) == 1 else "ies",
                     ctx.iteration, ", ".join(p.name for p in left))
