"""The compute behind the phases: ``rehearsal`` (simulated, no model) and ``rl`` (the
embedded engine or vLLM, and the GRPO trainer). ``make`` picks one from the config."""

from __future__ import annotations

from orchestrator.config import RunConfig
from orchestrator.config import WorkloadKind
from orchestrator.node.procs import Children
from orchestrator.runtime.context import Workload


def make(config: RunConfig, children: Children) -> Workload:
    """The workload ``config.workload`` names; its child processes go into ``children``."""
    if config.workload is WorkloadKind.REHEARSAL:
        from orchestrator.workloads.rehearsal import RehearsalWorkload

        return RehearsalWorkload(config, children)
    from orchestrator.workloads.rl.workload import RLWorkload

    return RLWorkload(config, children)
