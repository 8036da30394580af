"""What a phase's work gets to see (``PhaseContext``, built by the runner for each phase), and
the seam between the protocol and the compute (``Workload``, what a phase asks of it).

``runtime/phases/`` own the data flow (shards, manifests, aggregates, checkpoints and
their durability); a workload only produces records and runs the engine and the trainer.
The rehearsal workload (``workloads/rehearsal.py``) simulates all of it; the RL workload
(``workloads/rl/``) does it for real.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Protocol

from orchestrator.config import RunConfig
from orchestrator.phase_table import Phase
from orchestrator.protocol.layout import IterationLayout, RunLayout
from orchestrator.protocol.waiting import CancelToken

if TYPE_CHECKING:
    from orchestrator.protocol.coordinator import Coordinator


class Workload(Protocol):
    min_chunk_tasks: int
    """The smallest chunk of tasks worth handing out (what one engine request carries)."""

    def tasks_per_iteration(self, split: str) -> int:
        """How many ``split`` ("train" or "eval") tasks one iteration has."""

    def task_ids(self, split: str, iteration: int) -> list[str]:
        """The iteration's task ids of ``split``, the same on every rank."""

    def prompts_too_long(self, split: str) -> int:
        """How many ``split`` tasks the run leaves out for a prompt over rl.max_prompt_tokens."""

    def rollout_slots(self, ctx: PhaseContext) -> int:
        """How many chunks this rank works on at once (one per engine)."""

    def rollout(self, ctx: PhaseContext, split: str, task_ids: list[str]) -> Iterator[list[dict]]:
        """Batches of scored records, one record per task (with its ``task_id``). Each batch
        is made durable and counted before the next is asked for; checks ``ctx.cancel``."""

    def metrics(self, ctx: PhaseContext, eval_records: Path) -> dict:
        """Eval metrics (at least ``accuracy``) from the iteration's merged eval records."""

    def train(self, ctx: PhaseContext, train_config: dict, checkpoint_dir: Path | None) -> None:
        """Run this rank's part of training; the master writes the checkpoint into ``checkpoint_dir``."""

    def engine_start(self, ctx: PhaseContext) -> None: ...

    def engine_stop(self, ctx: PhaseContext) -> None: ...

    def close(self) -> None:
        """Stop whatever the workload still runs (the engine)."""


@dataclass(slots=True)
class PhaseContext:
    config: RunConfig
    layout: RunLayout
    iteration: int
    phase: Phase
    plan: dict
    cancel: CancelToken
    workload: Workload
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
        per_rank = self.plan[split]["per_rank"]  # a rank beyond the plan's (a resume on more nodes) has none
        return sum(per_rank[: self.rank]), per_rank[self.rank] if self.rank < len(per_rank) else 0

    def progress(self, done: int, total: int) -> None:
        self.coordinator.progress(done, total)
