"""`orchestrator plan`: the GPU placement a config resolves to, as a table or JSON.

For a described cluster (``--num-nodes``, ``--gpus-per-node``), for the GPUs this node
detects, or for the counts the nodes of a run reported when they joined (``--log-path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.protocol import records
from orchestrator.cli.rank import parse_weights
from orchestrator.cli.run_options import WEIGHTS_METAVAR
from orchestrator.config import build_sections, parse_overrides
from orchestrator.errors import EXIT_BAD_INPUT, ConfigError
from orchestrator.node import gpus, placement
from orchestrator.protocol import fsio, lease
from orchestrator.protocol.layout import RunLayout


@click.command()
@click.option("--num-nodes", type=int, default=None, metavar="N",
              help="Nodes in the cluster.  [default: the run's with --log-path, else 1]")
@click.option("--gpus-per-node", default=None, metavar="N|N0,N1,...",
              help="GPUs on each node, or one count per node (8,4,4).  [default: what this node detects]")
@click.option("--rank-weights", default="auto", show_default=True, metavar=WEIGHTS_METAVAR,
              help="Rollout weight per node, as for `run`, or auto.")
@click.option("--log-path", type=click.Path(path_type=Path), default=None, help="Use the GPU counts the nodes of this run reported.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema: docs/placement.md).")
@click.argument("overrides", nargs=-1)
def plan(num_nodes: int | None, gpus_per_node: str | None, rank_weights: str, log_path: Path | None, as_json: bool,
         overrides: tuple[str, ...]) -> None:
    """Show where train workers and engines go, and each node's share of the rollout.
    KEY=VALUE arguments as for `run` (`orchestrator config` lists them), e.g.
    train.device_mapping=0-7 rollout.device_mapping=0-7 rollout.gpus_per_engine=2."""
    try:
        sections = build_sections(parse_overrides(overrides))
        train = sections.get("train")
        rollout = sections.get("rollout")
        placement.check_mappings(train.device_mapping, rollout.device_mapping, rollout.gpus_per_engine)
        num_nodes, counts, source = _cluster(num_nodes, gpus_per_node, log_path)
        resolved = placement.resolve(
            num_nodes=num_nodes,
            gpus_per_node=counts,
            train_mapping=train.device_mapping,
            rollout_mapping=rollout.device_mapping,
            gpus_per_engine=rollout.gpus_per_engine,
            engine_port=rollout.engine_port,
            train_nodes=train.nodes,
            rollout_nodes=rollout.nodes,
            models=sections["models"],
        )
        given = parse_weights(rank_weights, num_nodes)
        if given is not None and len(given) != num_nodes:
            raise ConfigError(f"--rank-weights has {len(given)} value(s) but the cluster has {num_nodes} node(s)")
        weights = placement.rollout_weights(resolved, given)
    except ConfigError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    if as_json:
        terminal.out.print_json(json.dumps({**records.to_dict(resolved), "rollout_weights": list(weights), "cluster_source": source}))
        return
    _show(resolved, weights, source, rollout)


def _cluster(num_nodes: int | None, gpus_per_node: str | None, log_path: Path | None) -> tuple[int, tuple[int, ...], str]:
    if num_nodes is not None and num_nodes < 1:
        raise ConfigError(f"--num-nodes must be at least 1, got {num_nodes}")
    if log_path is not None and gpus_per_node is None:
        reports = _reported(log_path)
        if num_nodes is not None and num_nodes != len(reports):
            raise ConfigError(f"--num-nodes {num_nodes} but the run under {log_path} has {len(reports)} nodes")
        return len(reports), placement.cluster_gpus(reports), f"reported by the {len(reports)} node(s) of the run under {log_path}"
    if gpus_per_node is None:
        mine = gpus.detect()
        n = num_nodes or 1
        return n, (mine["count"],) * n, f"detected on this node ({mine['source']})"
    try:
        counts = tuple(int(c) for c in gpus_per_node.split(","))
    except ValueError:
        raise ConfigError(f"--gpus-per-node must be a count or one count per node (8,4,4), got {gpus_per_node!r}") from None
    if any(c < 0 for c in counts):
        raise ConfigError(f"--gpus-per-node must be >= 0, got {gpus_per_node}")
    if len(counts) > 1:
        if num_nodes is not None and num_nodes != len(counts):
            raise ConfigError(f"--gpus-per-node gives {len(counts)} counts but --num-nodes is {num_nodes}")
        return len(counts), counts, "described on the command line"
    n = num_nodes or 1
    return n, counts * n, "described on the command line"


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


def _show(resolved: placement.Placement, weights: tuple[float, ...], source: str, rollout) -> None:
    mode = ("CPU (no device mapping)" if resolved.colocated else
            "CPU (no device mapping), disaggregated: train.nodes and rollout.nodes share no node") if not resolved.gpus_per_engine else (
        "colocated: engines and training share GPUs; engines stop before each training step"
        if resolved.colocated else "disaggregated: engines and training use separate GPUs")
    counts = resolved.gpus_per_node
    cluster = f"{resolved.num_nodes} node(s) x {counts[0]} GPUs" if len(set(counts)) == 1 else (
        f"{resolved.num_nodes} nodes of {','.join(map(str, counts))} GPUs")
    terminal.out.print(terminal.line(f"{cluster} ({source}); {mode}"))
    total = sum(weights)
    terminal.display_table(
        "nodes: each rolls out and evaluates its weight's share of the tasks; only nodes with engines have a share",
        ["node", "GPUs", "train workers", "engines", "rollout weight", "share"],
        [[n, counts[n], len(resolved.train_workers_on(n)), len(resolved.engines_on(n)), f"{weights[n]:g}", f"{weights[n] / total:.0%}"]
         for n in range(resolved.num_nodes)],
    )
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
    if resolved.aux:
        terminal.display_table(
            "models beside the policy (models.<name>): an engine on each node that serves one",
            ["model", "node", "GPUs (node-local)"],
            [[name, e.node, _ids(list(e.gpus)) if e.gpus else "CPU"] for name, engines in resolved.aux.items() for e in engines],
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
