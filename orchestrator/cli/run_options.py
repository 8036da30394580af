"""The flags of `orchestrator run`, shared with `orchestrator local`."""

from __future__ import annotations

from pathlib import Path

import click

from orchestrator import preflight
from orchestrator.cli.rank import parse_weights, resolve_num_nodes, resolve_rank
from orchestrator.config import ENGINES, RolloutSplit, RunConfig, WorkloadKind, build_sections, parse_overrides
from orchestrator.data import run_keys
from orchestrator.errors import ConfigError
from orchestrator.phase_table import RLPhase

# Help texts other commands share: a computed default is written as click writes a fixed one.
NUM_NODES_HELP = "Number of nodes (ranks).  [default: SLURM_NTASKS under Slurm, else 1]"
WEIGHTS_METAVAR = "W,W,...|auto"

RUN_OPTIONS = [
    click.option("--data-path", required=True, type=click.Path(path_type=Path),
                 help="Absolute path of read-only inputs (task files, base model)."),
    click.option("--log-path", required=True, type=click.Path(path_type=Path),
                 help="Absolute shared path the run writes to; the same on every node."),
    click.option("--rl-phase", required=True, type=click.Choice([p.value for p in RLPhase]), help="rollout: phases 0-6; update: 7-13; both: 0-13."),
    click.option("--eval-interval", type=int, default=None, metavar="N",
                 help="Evaluate on iterations 1, 1+N, 1+2N, ... (required with --rl-phase both)."),
    click.option("--rollout-split", type=click.Choice([s.value for s in RolloutSplit]), default=None, help="Required with --rl-phase rollout."),
    click.option("--num-nodes", type=int, default=None, metavar="N", help=NUM_NODES_HELP),
    click.option("--rank-weights", default=None, metavar=WEIGHTS_METAVAR,
                 help='One weight per node, e.g. "2,1,1" (tasks split by largest remainder; 0 for a node without '
                      "engines), or auto: by the GPUs of each node's engines."),
    click.option("--max-iterations", type=int, default=None, metavar="N", help="Stop after iteration N.  [default: unbounded]"),
    click.option("--rehearsal", is_flag=True, help="Walk the full protocol with simulated work: no GPU or model needed."),
    click.option("--engine", type=click.Choice(ENGINES), default=None,
                 help="Inference engine, the same as rollout.engine=...; vllm needs the vllm extra.  [default: embedded]"),
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
    # Only RL tasks are graded; a rehearsal simulates its rewards.
    data_path = Path(params["data_path"])
    taken = () if params["rehearsal"] or not data_path.is_absolute() else run_keys.apply(overrides["sections"], data_path)
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
        workload=WorkloadKind.REHEARSAL if params["rehearsal"] else WorkloadKind.RL,
        debug_mode=params["debug_mode"],
        keys_from_data=taken,
        **sections,
    )
    preflight.check(config)
    return config


__all__ = ["RUN_OPTIONS", "RANK_OPTIONS", "apply", "build_config", "ConfigError"]
