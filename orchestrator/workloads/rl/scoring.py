"""Scoring completions with the user's reward, tolerating a few failures.

A reward that raises (or returns something that is not a finite number) scores the sample 0
and marks it: the sample's ``reward_error`` holds the end of the traceback. A rank logs the
first such traceback of each rollout and fails, naming the task, as soon as more than
``rl.max_reward_error_fraction`` of the samples it scored in that rollout failed. The batch
that crossed the line is never written, so at most that share of a shard's samples carry a
reward error; the master counts them per split in the iteration's summary (``reward_errors``).
"""

from __future__ import annotations

import logging
import math
import traceback
from dataclasses import dataclass

from orchestrator.errors import OrchestratorError
from orchestrator.plugins.rewards import Reward

log = logging.getLogger(__name__)

# The end of a reward's traceback kept with the sample: enough for the frame that raised.
ERROR_CHARS = 2000


class RewardFailed(OrchestratorError):
    """The reward function failed on more samples than ``rl.max_reward_error_fraction`` allows."""


@dataclass(slots=True)
class Scorer:
    reward: Reward | None
    """None with rl.environment: the environment scores, :meth:`check` counts its failures."""
    spec: str
    """``rl.reward=...`` (or ``rl.environment=...``), for messages."""
    max_fraction: float
    split: str
    samples: int = 0
    errors: int = 0
    first: tuple[str, str] | None = None
    """(task id, traceback) of the first failure this rollout."""

    def score(self, task: dict, completion: str) -> tuple[float, str | None]:
        """(reward, None), or (0.0, the traceback's end) when the reward fails. Thread-safe:
        it only reads; :meth:`check` does the counting."""
        try:
            value = float(self.reward(task, completion))
        except Exception:  # noqa: BLE001 - the user's code: any failure scores 0 and is reported
            return 0.0, traceback.format_exc()[-ERROR_CHARS:]
        if not math.isfinite(value):
            return 0.0, f"{self.spec} returned {value!r}, not a finite number"
        return value, None

    def check(self, batch: list[dict]) -> None:
        """Count ``batch``'s samples and failures; raise :class:`RewardFailed` (before the
        batch is written) when the share of failures passes the limit."""
        for record in batch:
            for sample in record["samples"]:
                self.samples += 1
                error = sample.get("reward_error")
                if error is None:
                    continue
                self.errors += 1
                if self.first is None:
                    self.first = (record["task_id"], error)
                    log.error("%s failed on %s task %s; the sample scores 0 (at most %g of the samples may fail):\n%s",
                              self.spec, self.split, record["task_id"], self.max_fraction, error.rstrip())
        if self.samples and self.errors / self.samples > self.max_fraction:
            task_id, error = self.first
            raise RewardFailed(
                f"{self.spec} failed on {self.errors} of {self.samples} {self.split} samples, more than "
                f"rl.max_reward_error_fraction={self.max_fraction:g}; first on task {task_id}: {last_line(error)}. "
                f"Fix the {_culprit(self.spec)}, then re-run the same command: written tasks are kept"
            )


def _culprit(spec: str) -> str:
    if spec.endswith(":judge"):
        return "judge (judge.model, judge.template, judge.parse)"
    return "environment" if spec.startswith("rl.environment") else "agent" if spec.startswith("rl.agent") else "reward function"


def last_line(error: str) -> str:
    lines = error.strip().splitlines()
    return lines[-1] if lines else error
