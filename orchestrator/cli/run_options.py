"""The flags of `orchestrator run` (SPEC section 2), shared with `orchestrator local`."""

from __future__ import annotations

from pathlib import Path

import click

from orchestrator import preflight
from orchestrator.cli.rank import parse_weights, resolve_num_nodes, resolve_rank
from orchestrator.config import ENGINES, RolloutSplit, RunConfig, Workload, build_sections, parse_overrides
from orchestrator.errors import ConfigError
from orchestrator.phase_table import RLPhase

RUN_OPTIONS = [
    click.option("--data-path", required=True, help="Absolute path of read-only inputs (task files, base model)."),
    click.option("--log-path", required=True, help="Absolute shared path the run writes to; the same on every node."),
    click.option("--rl-phase", required=True, type=click.Choice([p.value for p in RLPhase]), help="rollout: phases 0-6; update: 7-13; both: 0-13."),
    click.option("--eval-interval", type=int, default=None, help="Evaluate on iterations 1, 1+N, ... (required with both)."),
    click.option("--rollout-split", type=click.Choice([s.value for s in RolloutSplit]), default=None, help="Required with --rl-phase rollout."),
    click.option("--num-nodes", type=int, default=None, help="Number of nodes (ranks). Default: SLURM_NTASKS under Slurm, else 1."),
    click.option("--rank-weights", default=None, help='One positive weight per node, e.g. "2,1,1"; tasks split by largest remainder.'),
    click.option("--max-iterations", type=int, default=None, help="Stop after this iteration (default: unbounded)."),
    click.option("--rehearsal", is_flag=True, help="Walk the full protocol with simulated work: no GPU or model needed."),
    click.option("--engine", type=click.Choice(ENGINES), default=None,
                 help="Inference engine (default embedded; same as rollout.engine=...). vllm needs the vllm extra."),
    click.option("--debug-mode", is_flag=True, help="Do not start or stop the inference engine; use one already running."),
    click.option("--resume", is_flag=True, help="Accepted for compatibility: resuming is automatic."),
    click.argument("overrides", nargs=-1),
]

RANK_OPTIONS = [
    click.option("--master", is_flag=True, help="This node is rank 0."),
    click.option("--worker", type=int, default=None, metavar="R",
                 help="This node is worker rank R (else env RANK, then NODE_RANK, then SLURM_PROCID)."),
]


def apply(options):
    def decorator(f):
        for option in reversed(options):
            f = option(f)
        return f

    return decorator


def build_config(params: dict, rank: int | None = None) -> RunConfig:
    """A validated RunConfig from the parsed flags, checked against this node (``preflight``);
    raises ConfigError on bad input."""
    num_nodes = resolve_num_nodes(params["num_nodes"])
    if rank is None:
        rank = resolve_rank(params.get("master", False), params.get("worker"), num_nodes)
    overrides = parse_overrides(params["overrides"])
    engine = params.get("engine")
    if engine is not None:
        given = overrides["sections"]["rollout"].get("engine")
        if given is not None and given != engine:
            raise ConfigError(f"--engine {engine} contradicts rollout.engine={given}: give one of them")
        overrides["sections"]["rollout"]["engine"] = engine
    sections = build_sections(overrides)
    config = RunConfig(
        data_path=Path(params["data_path"]),
        log_path=Path(params["log_path"]),
        rl_phase=RLPhase(params["rl_phase"]),
        rank=rank,
        num_nodes=num_nodes,
        rank_weights=parse_weights(params["rank_weights"], num_nodes),
        eval_interval=params["eval_interval"],
        rollout_split=RolloutSplit(params["rollout_split"]) if params["rollout_split"] else None,
        max_iterations=params["max_iterations"],
        workload=Workload.REHEARSAL if params["rehearsal"] else Workload.RL,
        debug_mode=params["debug_mode"],
        **sections,
    )
    preflight.check(config)
    return config


__all__ = ["RUN_OPTIONS", "RANK_OPTIONS", "apply", "build_config", "ConfigError"]
