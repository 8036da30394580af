"""Phases 8-9: the master checks the training data and releases the iteration's training plan."""

from __future__ import annotations

import os

from orchestrator.protocol import records
from orchestrator.data import shards, staleness
from orchestrator.errors import BadInput
from orchestrator.protocol.schema import TrainingPlan
from orchestrator.runtime import decisions
from orchestrator.runtime.context import PhaseContext
from orchestrator.runtime.phases import aggregate


class MissingTrainingData(BadInput):
    """``--rl-phase update`` for an iteration whose rollout has not run: the user runs it (exit 2)."""


def check_training_data(ctx: PhaseContext) -> None:
    _rebuild_if_damaged(ctx)
    m = shards.sealed(ctx.it.aggregate("train"))
    if m is None:
        raise MissingTrainingData(
            f"iteration {ctx.iteration} has no sealed train aggregate ({ctx.it.aggregate('train')}); "
            f"run --rl-phase rollout --rollout-split train-only for it first"
        )
    carried = ctx.config.rollout.max_carry if ctx.config.rollout.partial else 0  # a carried group's first tokens are older
    staleness.check(ctx.iteration, ctx.config.rl.max_staleness + carried, m.extra.get("policy_iterations"),
                    f"the train aggregate of iteration {ctx.iteration}")
    if m.extra.get("partial") and not ctx.config.rl.train_on_partial:
        per_source = ", ".join(f"{label}: {n}" for label, n in m.extra.get("per_source", {}).items())
        raise BadInput(
            f"the train aggregate of iteration {ctx.iteration} is partial: {m.count} of {m.extra.get('planned', '?')} "
            f"planned tasks ({per_source}), salvaged by `orchestrator recover`. Add rl.train_on_partial=true to train "
            f"on it, or re-run the rollout (--rl-phase rollout --rollout-split train-only) to complete it"
        )


def _rebuild_if_damaged(ctx: PhaseContext) -> None:
    """The trainer reads the aggregate next: check every byte against its manifest, and
    rebuild a damaged full aggregate from the ranks' sealed shards (moved aside, not lost)."""
    dest = ctx.it.aggregate("train")
    m = shards.read_manifest(dest)
    if m is None or not dest.exists() or shards.verify(dest, m):
        return
    if m.extra.get("partial"):
        raise shards.ShardError(f"the salvaged partial aggregate {dest} does not match its manifest; salvage it again "
                                f"(orchestrator recover --salvage {ctx.iteration} --apply)")
    aside = dest.with_name(f"{dest.name}.damaged-{ctx.attempt_id}")
    ctx.log.warning("the train aggregate of iteration %d does not match its manifest; moved to %s, rebuilding it from "
                    "the ranks' shards", ctx.iteration, aside.name)
    os.replace(dest, aside)
    shards.manifest_path(dest).unlink(missing_ok=True)
    aggregate.train_aggregate(ctx)


def training_plan(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    """Master: what the iteration's update trains on (the sealed train aggregate) and the
    policy it starts from (the one the run has published), released to every rank."""
    aggregate_path = ctx.it.aggregate("train")
    m = shards.sealed(aggregate_path)
    policy = ctx.policy
    plan = TrainingPlan(
        iteration=ctx.iteration,
        data=str(aggregate_path.relative_to(ctx.layout.root)),
        records=m.count,
        init=None if policy.is_base else str(policy.path.relative_to(ctx.layout.root)),
        init_iteration=policy.iteration,
        output=str(ctx.layout.checkpoint(ctx.iteration).relative_to(ctx.layout.root)),
    )
    return {decisions.TRAINING: records.to_dict(plan)}
