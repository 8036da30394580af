"""Phases 5-6: the master decides whether eval is due; every rank evaluates its share;
the master merges the eval shards and computes the metrics."""

from __future__ import annotations

from orchestrator.data import summary
from orchestrator.runtime.context import PhaseContext
from orchestrator.runtime.phases.aggregate import merge_split, note_reward_errors
from orchestrator.runtime.phases.rollout import generate_shard, seal_shard


def decide(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    return {"eval_due": ctx.plan["eval"]["enabled"]}


def run_eval_share(ctx: PhaseContext) -> dict | None:
    if not ctx.plan["eval"]["enabled"]:
        return None
    generate_shard(ctx, "eval")
    return seal_shard(ctx, "eval")


def aggregate_results(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    if not ctx.plan["eval"]["enabled"]:
        return {}
    m = merge_split(ctx, "eval")
    note_reward_errors(ctx, "eval", m)
    metrics = ctx.workload.metrics(ctx, ctx.it.aggregate("eval"))
    policies = m.extra.get("policy_iterations")
    if ctx.config.rl.max_staleness and policies:  # the checkpoint evaluated lags the iteration (rl.md, "Asynchronous RL")
        metrics["policy_iteration"] = policies[0]
    summary.update(ctx.layout, ctx.iteration, evaluated=True, metrics=metrics)
    summary.append_metrics(ctx.layout, ctx.iteration, metrics)
    ctx.log.info("eval of iteration %d%s: %s", ctx.iteration,
                 " (simulated by the rehearsal: no model ran)" if ctx.workload.simulated else "",
                 ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return {"metrics": metrics}
