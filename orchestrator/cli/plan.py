"""`orchestrator plan`: the GPU placement a config resolves to, as a table or JSON.

For a described cluster (``--num-nodes``, ``--gpus-per-node``), for the GPUs this node
detects, or for the counts the nodes of a run reported when they joined (``--log-path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchestrator import records, terminal
from orchestrator.config import build_sections, parse_overrides
from orchestrator.errors import EXIT_BAD_INPUT, ConfigError
from orchestrator.node import gpus, placement
from orchestrator.protocol import fsio, lease
from orchestrator.protocol.layout import RunLayout


@click.command()
@click.option("--num-nodes", type=int, default=None, help="Nodes in the cluster (default 1, or the run's with --log-path).")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs on each node (default: what this node detects).")
@click.option("--log-path", type=click.Path(path_type=Path), default=None, help="Use the GPU counts the nodes of this run reported.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.argument("overrides", nargs=-1)
def plan(num_nodes: int | None, gpus_per_node: int | None, log_path: Path | None, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Show where train workers and engines go. KEY=VALUE arguments as for `run`, e.g.
    train.device_mapping=0-7 rollout.device_mapping=0-7 rollout.gpus_per_engine=2."""
    try:
        sections = build_sections(parse_overrides(overrides))
        train = sections.get("train")
        rollout = sections.get("rollout")
        placement.check_mappings(train.device_mapping, rollout.device_mapping, rollout.gpus_per_engine)
        num_nodes, gpus_per_node, source = _cluster(num_nodes, gpus_per_node, log_path)
        resolved = placement.resolve(
            num_nodes=num_nodes,
            gpus_per_node=gpus_per_node,
            train_mapping=train.device_mapping,
            rollout_mapping=rollout.device_mapping,
            gpus_per_engine=rollout.gpus_per_engine,
            engine_port=rollout.engine_port,
        )
        placement.check_runnable(resolved)
    except ConfigError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    if as_json:
        terminal.out.print_json(json.dumps({**records.to_dict(resolved), "cluster_source": source}))
        return
    _show(resolved, source, rollout)


def _cluster(num_nodes: int | None, gpus_per_node: int | None, log_path: Path | None) -> tuple[int, int, str]:
    if num_nodes is not None and num_nodes < 1:
        raise ConfigError(f"--num-nodes must be at least 1, got {num_nodes}")
    if gpus_per_node is not None and gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be >= 0, got {gpus_per_node}")
    if log_path is not None and gpus_per_node is None:
        reports = _reported(log_path)
        count = placement.cluster_gpus(reports)
        if num_nodes is not None and num_nodes != len(reports):
            raise ConfigError(f"--num-nodes {num_nodes} but the run under {log_path} has {len(reports)} nodes")
        return len(reports), count, f"reported by the {len(reports)} node(s) of the run under {log_path}"
    if gpus_per_node is None:
        mine = gpus.detect()
        return num_nodes or 1, mine["count"], f"detected on this node ({mine['source']})"
    return num_nodes or 1, gpus_per_node, "described on the command line"


def _reported(log_path: Path) -> dict[int, dict]:
    if not log_path.is_absolute():
        raise ConfigError(f"--log-path must be absolute, got {log_path}")
    layout = RunLayout(log_path)
    current = lease.read_lease(layout)
    if current is None:
        raise ConfigError(f"no run has started under {log_path}: nothing reported GPU counts")
    attempt = layout.attempt(current.attempt)
    start = fsio.read_record(attempt.start)
    if start is None or "gpus" not in start:
        raise ConfigError(f"attempt {current.attempt} under {log_path} has not started: its nodes' GPU counts are not known yet")
    return {int(n): r for n, r in start["gpus"].items()}


def _show(resolved: placement.Placement, source: str, rollout) -> None:
    mode = "CPU (no device mapping)" if not resolved.gpus_per_node and not resolved.gpus_per_engine else (
        "colocated: engines and training share GPUs; engines stop before each training step"
        if resolved.colocated else "disaggregated: engines and training use separate GPUs")
    terminal.out.print(f"{resolved.num_nodes} node(s) x {resolved.gpus_per_node} GPUs ({source}); {mode}")
    terminal.display_table(
        f"{len(resolved.train_workers)} train worker(s)",
        ["node", "ranks", "GPUs (node-local)"],
        [[n, _ids([w.rank for w in ws]), _ids([w.gpu for w in ws]) if ws[0].gpu is not None else "CPU"]
         for n in range(resolved.num_nodes) if (ws := resolved.train_workers_on(n))],
    )
    each = (f"{resolved.gpus_per_engine} GPU(s) each (tensor parallel {rollout.tensor_parallel_size}, "
            f"pipeline {rollout.pipeline_parallel_size})" if resolved.gpus_per_engine else "on CPU")
    terminal.display_table(
        f"{len(resolved.engines)} engine(s), {rollout.engine}, {each}",
        ["engine", "node", "GPUs (node-local)", "port"],
        [[e.engine, e.node, _ids(list(e.gpus)) if e.gpus else "CPU", e.port] for e in resolved.engines],
    )


def _ids(ids: list) -> str:
    """0,1,2,3 as 0-3; gaps kept: 0-1,4."""
    out, run = [], []
    for i in ids:
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
