"""Phase 10: every rank trains; the node of train worker 0 (the master unless the placement
says otherwise) makes a staging directory, where the checkpoint is written (by worker 0, or
by every worker its shard with train.strategy=fsdp), seals it and renames it into place, so a
checkpoint directory is either complete or absent."""

from __future__ import annotations

from orchestrator.checkpoints import store
from orchestrator.runtime.context import PhaseContext


def train(ctx: PhaseContext) -> None:
    """This rank's part of the iteration's training, as phase 9's released plan says."""
    plan = ctx.training
    if plan is None:  # phase 9's release, or progress.json at a resume, carries it: never absent
        raise RuntimeError(f"iteration {ctx.iteration} has no released training plan at phase {ctx.phase.label}")
    if store.exists(ctx.layout, ctx.iteration):
        ctx.log.info("checkpoint of iteration %d exists already: not training again", ctx.iteration)
        if ctx.rank == ctx.run.placement.checkpoint_node:
            _remove_stagings(ctx)
        return
    if ctx.rank != ctx.run.placement.checkpoint_node:
        ctx.workload.train(ctx, plan, None)
        return
    staging = store.new_staging(ctx.layout, ctx.iteration, ctx.attempt_id, ctx.run.train_round)
    ctx.workload.train(ctx, plan, staging)
    store.place(ctx.layout, ctx.iteration, staging)
    _remove_stagings(ctx)


def _remove_stagings(ctx: PhaseContext) -> None:
    left = store.remove_stagings(ctx.layout, ctx.iteration)
    if left:
        ctx.log.info("removed %d staging director%s of earlier tries of iteration %d: %s", len(left), "y" if len(left) == 1 else "ies",
                     ctx.iteration, ", ".join(p.name for p in left))
