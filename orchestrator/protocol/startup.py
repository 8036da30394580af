"""What the master settles once every rank has joined, before the attempt starts: the
preflight (what usually breaks multi-node runs later) and the GPU placement.

Both read only what the ranks wrote in their join records; neither writes. A placement the
cluster does not fit is the attempt's end (exit 2): :class:`Unplaceable` names the node to
blame, and the coordinator publishes it as the abort.
"""

from __future__ import annotations

import logging

from orchestrator.config import RunConfig
from orchestrator.errors import ConfigError, Culprit, FailureKind
from orchestrator.node import checks, facts
from orchestrator.node import placement as placement_mod

log = logging.getLogger(__name__)


class Unplaceable(Exception):
    """The cluster does not fit the GPU placement; ``culprit`` is the node to blame."""

    def __init__(self, culprit: Culprit):
        super().__init__(culprit.error)
        self.culprit = culprit


def quick_facts(config: RunConfig, gpus: dict) -> dict | None:
    """What the master's preflight compares (doctor's quick subset: versions, NCCL/Gloo
    settings, interfaces, GPUs, free space); never a reason not to join."""
    try:
        return facts.collect(rank=config.rank, num_nodes=config.num_nodes, log_path=config.log_path, quick=True, gpus=gpus)
    except Exception as e:  # noqa: BLE001 - a preflight must not stop the run
        log.warning("could not collect this node's facts for the preflight: %s", e)
        return None


def preflight(joins: dict[int, dict], node_timeout_s: float) -> None:
    """Warn about what usually breaks multi-node runs later (`orchestrator doctor` checks more);
    ``joins``: every rank's join record, the master's included."""
    found = {r: j["doctor"] for r, j in joins.items() if j.get("doctor")}
    try:
        problems = checks.quick_problems(found, checks.Thresholds(node_timeout_s=node_timeout_s))
    except Exception as e:  # noqa: BLE001
        log.warning("preflight checks failed to run: %s", e)
        return
    for p in problems:
        log.warning("preflight: %s", checks.describe(p))


def place(config: RunConfig, reports: dict[int, dict]) -> placement_mod.Placement:
    """The placement for the GPUs the nodes reported (``reports``: node -> its GPU report and
    host), decided once by the master before any work. Raises :class:`Unplaceable`."""
    train, rollout = config.train, config.rollout
    try:
        gpus_per_node = placement_mod.cluster_gpus(reports) if train.device_mapping else 0
        resolved = placement_mod.resolve(
            num_nodes=config.num_nodes, gpus_per_node=gpus_per_node, train_mapping=train.device_mapping,
            rollout_mapping=rollout.device_mapping, gpus_per_engine=rollout.gpus_per_engine, engine_port=rollout.engine_port,
            train_nodes=train.nodes, rollout_nodes=rollout.nodes,
        )
        placement_mod.rollout_weights(resolved, config.rank_weights, [reports[n]["host"] for n in sorted(reports)])
        if config.rl.max_staleness and resolved.colocated:
            raise ConfigError(f"rl.max_staleness={config.rl.max_staleness} runs rollout while training, so the engines need GPUs "
                              f"of their own, but the device mappings share some with the train workers: map them apart")
    except ConfigError as e:
        seen = "; ".join(f"node {n} ({r['host']}): {r['count']} GPU(s) ({r['source']})" for n, r in sorted(reports.items()))
        node = _short_node(reports)
        message = f"the cluster does not fit the GPU placement: {e}. The nodes report: {seen}"
        raise Unplaceable(Culprit(node, reports[node]["host"], None, None, FailureKind.ERROR, message)) from None
    if resolved.on_gpu:
        log.info("placement: %d train worker(s), %d engine(s), %s", len(resolved.train_workers), len(resolved.engines),
                 "colocated" if resolved.colocated else "disaggregated")
    return resolved


def _short_node(reports: dict[int, dict]) -> int:
    """The node to blame: the one with the fewest GPUs when counts differ, else node 0."""
    counts = {n: r["count"] for n, r in reports.items()}
    if len(set(counts.values())) > 1:
        return min(counts, key=lambda n: (counts[n], n))
    return 0
