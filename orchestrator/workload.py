"""The seam between the protocol and the compute: what a phase asks of the workload.

``phases/`` own the data flow (shards, manifests, aggregates, checkpoints and their
durability); a workload only produces records and runs the engine and the trainer. The
rehearsal workload (``rehearsal.py``) simulates all of it; the RL workload does it for real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

from orchestrator.context import PhaseContext


class Workload(Protocol):
    def tasks_per_iteration(self, split: str) -> int:
        """How many ``split`` ("train" or "eval") tasks one iteration has."""

    def task_ids(self, split: str, iteration: int) -> list[str]:
        """The iteration's task ids of ``split``, the same on every rank."""

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
