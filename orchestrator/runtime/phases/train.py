"""Phase 10: every rank trains; the node of train worker 0 (the master unless the placement
says otherwise) makes a staging directory, where the checkpoint is written (by worker 0, or
by every worker its shard with train.strategy=fsdp), seals it and renames it into place, so a
checkpoint directory is either complete or absent."""

from __future__ import annotations

import os
import shutil

from orchestrator.data import checkpoints
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
    final = ctx.layout.checkpoint(ctx.iteration)
    fsio.refresh_dir(final.parent)  # every rank must see a checkpoint an earlier attempt renamed into place
    if final.is_dir():
        ctx.log.info("checkpoint of iteration %d exists already: not training again", ctx.iteration)
        if ctx.rank == ctx.run.placement.checkpoint_node:
            _remove_stagings(ctx)
        return
    if ctx.rank != ctx.run.placement.checkpoint_node:
        ctx.workload.train(ctx, cfg, None)
        return
    staging = ctx.layout.checkpoint_staging(ctx.iteration, ctx.attempt_id, ctx.run.train_round)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    ctx.workload.train(ctx, cfg, staging)
    checkpoints.seal(staging)  # it checks that every shard an index names is there (other nodes write some)
    fsio.fsync_dir(staging)
    os.replace(staging, final)
    fsio.fsync_dir(final.parent)
    _remove_stagings(ctx)


def _remove_stagings(ctx: PhaseContext) -> None:
    """Once the checkpoint is in place, the staging directories of the tries that never got
    there: an attempt that crashed in this phase, a round a lost rank cut short (elastic)."""
    left = ctx.layout.checkpoint_stagings(ctx.iteration)
    for staging in left:
        shutil.rmtree(staging, ignore_errors=True)
    if left:
        ctx.log.info("removed %d staging director%s of earlier tries of iteration %d: %s", len(left), "y" if len(left) == 1 else "ies",
                     ctx.iteration, ", ".join(p.name for p in left))
