"""What the master checks once every rank has joined, before the attempt starts: the
preflight of what usually breaks multi-node runs later, from what the ranks wrote in their
join records (``quick_facts``, each rank's part). The GPU placement is node/placement.py's."""

from __future__ import annotations

import logging

from orchestrator.config import RunConfig
from orchestrator.node import checks, facts

log = logging.getLogger(__name__)


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
