"""Phases 0 and 13: the iteration's plan at the start; at the end, the master removes the
checkpoints retention no longer keeps, and marks the iteration complete."""

from __future__ import annotations

from orchestrator.config import RolloutSplit
from orchestrator.config import WorkloadKind
from orchestrator.checkpoints import retention
from orchestrator.data import carry, claims, resample, summary
from orchestrator.phase_table import RLPhase, eval_due
from orchestrator.protocol import fsio
from orchestrator.runtime.context import PhaseContext
from orchestrator.runtime.phases import rollout


def make_plan(ctx: PhaseContext) -> dict:
    """Who rolls out how many tasks of each split this iteration, first (``per_rank``), in
    which chunks: a pure function of the config, the placement (``--rank-weights auto``), the
    ranks in the run and the iteration; made once and kept."""
    cfg = ctx.config
    if cfg.rl_phase is RLPhase.ROLLOUT:
        train = cfg.rollout_split is RolloutSplit.TRAIN_ONLY
        evaluate = cfg.rollout_split is RolloutSplit.EVAL_ONLY
    else:
        train = True
        evaluate = eval_due(ctx.iteration, cfg.eval_interval)
    plan = {"iteration": ctx.iteration}
    if train and cfg.workload is WorkloadKind.RL and cfg.rollout.partial and ctx.iteration > 1:  # what every rank reads first
        carry.ensure(ctx.layout.iteration(ctx.iteration - 1).aggregate("carry"), ctx.iteration - 1)
    weights = rollout.weights(ctx)  # a rank the run goes on without (coordination.elastic) gets none
    c = cfg.coordination

    def split_plan(total: int, enabled: bool = True) -> dict:
        return {"enabled": enabled, **claims.plan_split(total, weights, stealing=c.work_stealing, chunk_tasks=c.chunk_tasks,
                                                      min_chunk_tasks=ctx.workload.min_chunk_tasks)}

    for split, enabled in (("train", train), ("eval", evaluate)):
        plan[split] = split_plan(ctx.workload.tasks_per_iteration(split) if enabled else 0, enabled)
    if train and cfg.workload is WorkloadKind.RL and cfg.rl.filter_groups:  # each resample round a split of its own (data/resample.py)
        rounds = 0
        for k in range(1, cfg.rl.max_resample_rounds + 1):
            total = ctx.workload.tasks_per_iteration(resample.split_of(k))
            if not total:
                break  # the train file has no task left that earlier rounds did not draw
            plan[resample.split_of(k)] = split_plan(total)
            rounds = k
        plan["train"]["resample_rounds"] = rounds
    return plan


def plan_iteration(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    """Master: the iteration's plan, made once and kept (a resumed run reuses it)."""
    plan = fsio.read_record(ctx.it.plan)
    if plan is None:
        plan = make_plan(ctx)
        fsio.write_record(ctx.it.plan, plan)
    too_long = {split: n for split in ("train", "eval") if plan[split]["enabled"] and (n := ctx.workload.prompts_too_long(split))}
    summary.update(ctx.layout, ctx.iteration, tasks_per_rank=plan["train"]["per_rank"], prompts_too_long=too_long or None)
    return {"plan": plan}


def finish_iteration(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    summary.update(ctx.layout, ctx.iteration, complete=True)
    ctx.log.info("iteration %d complete", ctx.iteration)
    return {}


def prune_checkpoints(ctx: PhaseContext) -> None:
    """Master: after the phase 12 barrier every engine serves the new checkpoint and every
    trainer is done with the old one, so older checkpoints beyond ``checkpoint.*`` can go."""
    keys = ctx.config.checkpoint
    retention.prune(ctx.layout, ctx.policy, keys.keep_last, keys.keep_every, ctx.log, ranks=ctx.config.num_nodes,
                    before_delete=lambda _trash: ctx.fault_point("hold-in-removal"))
