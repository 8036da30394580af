"""What a phase's work gets to see: one object, built by the runner for each phase."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.config import RunConfig
from orchestrator.layout import IterationLayout, RunLayout
from orchestrator.phase_table import Phase
from orchestrator.waiting import CancelToken

if TYPE_CHECKING:
    from orchestrator.coordinator import Coordinator
    from orchestrator.workload import Workload


@dataclass(slots=True)
class PhaseContext:
    config: RunConfig
    layout: RunLayout
    iteration: int
    phase: Phase
    plan: dict
    cancel: CancelToken
    workload: "Workload"
    coordinator: "Coordinator"
    log: logging.Logger

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def is_master(self) -> bool:
        return self.config.rank == 0

    @property
    def attempt_id(self) -> str:
        return self.coordinator.attempt_id or ""

    @property
    def it(self) -> IterationLayout:
        return self.layout.iteration(self.iteration)

    def share(self, split: str) -> tuple[int, int]:
        """(offset, count) of this rank's slice of the iteration's ``split`` tasks."""
        per_rank = self.plan[split]["per_rank"]
        return sum(per_rank[: self.rank]), per_rank[self.rank]

    def progress(self, done: int, total: int) -> None:
        self.coordinator.progress(done, total)
