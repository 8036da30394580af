"""The rehearsal workload: simulated compute, real data flow.

Rollout writes real records (``rehearsal.record_bytes`` of payload each) keyed by task id,
spending ``rehearsal.task_s`` per task (by default, ``rehearsal.work_s`` over a rank's first
share), times a rank's factor in ``rehearsal.slow_ranks``; training takes ``rehearsal.train_s``
(by default ``work_s``) on a node with train workers. The "engine" is a real child
process (``sleep infinity``) that idles until stopped, so process-tree handling is exercised too. Eval accuracy
rises with the iteration, deterministically, so curves look like a run's.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path
from typing import Iterator

from orchestrator.config import RunConfig
from orchestrator.node.procs import Children
from orchestrator.protocol import fsio
from orchestrator.protocol.schema import TrainingPlan
from orchestrator.runtime.context import PhaseContext, SerialPipe

_GOLDEN = (5**0.5 - 1) / 2
BATCH_S = 0.1


def _spread(seed: int, task_id: str) -> float:
    """A number in [0, 1) per task such that any run of consecutive tasks covers [0, 1)
    evenly (a golden-ratio sequence), so that "correct if below p" yields a share close to
    p even on a handful of eval tasks: the simulated accuracy rises smoothly."""
    index = int(task_id.rsplit("-", 1)[1])
    offset = int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "big") / 2**32
    return (offset + index * _GOLDEN) % 1.0


class RehearsalWorkload:
    min_chunk_tasks = 1
    simulated = True

    def __init__(self, config: RunConfig, children: Children):
        self.config = config
        self.r = config.rehearsal
        self.children = children
        self.engine: subprocess.Popen | None = None

    def tasks_per_iteration(self, split: str) -> int:
        return self.r.tasks if split == "train" else self.r.eval_tasks

    def prompts_too_long(self, split: str) -> int:
        return 0

    def notes(self) -> list[str]:
        return []

    def task_ids(self, split: str, iteration: int) -> list[str]:
        return [f"{split}-{iteration:06d}-{k:06d}" for k in range(self.tasks_per_iteration(split))]

    def rollout_pipe(self, ctx: PhaseContext, split: str) -> SerialPipe:
        return SerialPipe(lambda task_ids: self.rollout(ctx, split, task_ids))

    def task_seconds(self, ctx: PhaseContext, split: str) -> float:
        """Simulated seconds per task on this rank."""
        per_task = self.r.task_s or self.r.work_s / max(1, ctx.share(split)[1])
        return per_task * self.r.slowdown.get(ctx.rank, 1.0)

    def rollout(self, ctx: PhaseContext, split: str, task_ids: list[str]) -> Iterator[list[dict]]:
        if not task_ids:
            return
        per_task = self.task_seconds(ctx, split)
        # Batches of at least BATCH_S of simulated work: each is fsynced and counted, which
        # costs milliseconds, as a batch of engine requests would.
        batch = max(1, len(task_ids) // 20, math.ceil(BATCH_S / per_task) if per_task > 0 else len(task_ids))
        p_correct = min(0.95, 0.25 + 0.1 * ctx.iteration)
        policy = ctx.policy.iteration
        for start in range(0, len(task_ids), batch):
            chunk = task_ids[start : start + batch]
            ctx.cancel.sleep(per_task * len(chunk))
            yield [self._record(ctx, split, task_id, p_correct, policy) for task_id in chunk]

    def _record(self, ctx: PhaseContext, split: str, task_id: str, p_correct: float, policy: int) -> dict:
        correct = _spread(self.config.seed, task_id) < p_correct
        return {
            "task_id": task_id,
            "split": split,
            "iteration": ctx.iteration,
            "rank": ctx.rank,
            "attempt": ctx.attempt_id,
            "policy_iteration": policy,
            "reward": 1.0 if correct else 0.0,
            "response": "x" * self.r.record_bytes,
        }

    def metrics(self, ctx: PhaseContext, eval_records: Path) -> dict:
        n, correct = 0, 0.0
        with open(eval_records, "rb") as f:
            for line in f:
                n += 1
                correct += json.loads(line)["reward"]
        return {"accuracy": correct / n if n else 0.0, "mean_reward": correct / n if n else 0.0, "samples": n}

    def train(self, ctx: PhaseContext, plan: TrainingPlan, checkpoint_dir: Path | None) -> None:
        if ctx.run.placement.train_workers_on(ctx.rank):  # a node without train workers waits at the barrier
            ctx.cancel.sleep(self.r.train_s or self.r.work_s)
        if checkpoint_dir is not None:
            fsio.write_record(
                checkpoint_dir / "marker.json",
                {"iteration": ctx.iteration, "records": plan.records, "rehearsal": True},
            )

    def engine_start(self, ctx: PhaseContext) -> None:
        if self.engine is None and not self.config.debug_mode and ctx.run.placement.engines_on(ctx.rank):
            # A real child process that idles until stopped: what the protocol needs of an
            # engine here, at the start-up cost of coreutils rather than of an interpreter.
            self.engine = self.children.start(["sleep", "infinity"])

    def engine_stop(self, ctx: PhaseContext) -> None:
        if self.engine is not None:
            self.children.stop(self.engine)
            self.engine = None

    def close(self) -> None:
        if self.engine is not None:
            self.children.stop(self.engine)
            self.engine = None
