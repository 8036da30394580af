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
from typing import Callable, Iterator, Protocol

from orchestrator.checkpoints.store import Checkpoint
from orchestrator.config import RunConfig
from orchestrator.node.placement import Placement
from orchestrator.phase_table import Phase
from orchestrator.protocol.layout import AttemptLayout, IterationLayout, RunLayout
from orchestrator.protocol.schema import TrainingPlan
from orchestrator.protocol.waiting import Backoff, CancelToken


class RolloutPipe(Protocol):
    """A rollout in progress: the phase claims chunks of tasks while the pipe ``wants_more``,
    ``submit``s their tasks, and makes each batch ``next_batch`` returns durable before it
    counts it. ``outstanding``: tasks submitted whose records have not come back."""

    outstanding: int

    def wants_more(self) -> bool: ...

    def submit(self, task_ids: list[str]) -> None: ...

    def next_batch(self, timeout_s: float) -> list[dict]:
        """Scored records, one per task (with its ``task_id``), or [] when none came within ``timeout_s``."""

    def close(self) -> None: ...


class SerialPipe:
    """A pipe over a generator of record batches (``rollout(task_ids)``), one chunk at a time."""

    def __init__(self, rollout: Callable[[list[str]], Iterator[list[dict]]]):
        self._rollout = rollout
        self._batches: Iterator[list[dict]] | None = None
        self.outstanding = 0

    def wants_more(self) -> bool:
        return self._batches is None

    def submit(self, task_ids: list[str]) -> None:
        self._batches = self._rollout(task_ids)
        self.outstanding = len(task_ids)

    def next_batch(self, timeout_s: float) -> list[dict]:
        batch = next(self._batches, None) if self._batches is not None else None
        if batch is None:
            self._batches, self.outstanding = None, 0
            return []
        self.outstanding -= len(batch)
        if self.outstanding <= 0:
            self._batches = None
        return batch

    def close(self) -> None:
        self._batches = None


class Tracker(Protocol):
    """What the runner asks of experiment tracking (tracking/tracker.py): ``poke`` after an
    iteration's last barrier and at each attempt's start (it logs what is complete, off the
    barriers' path), ``close`` once the rank ends."""

    def poke(self) -> None: ...

    def close(self) -> None: ...


class Workload(Protocol):
    min_chunk_tasks: int
    """The smallest chunk of tasks worth handing out (what one engine request carries)."""
    simulated: bool
    """Its rewards and metrics are made up (the rehearsal): the log says so beside them."""

    def tasks_per_iteration(self, split: str) -> int:
        """How many ``split`` ("train" or "eval") tasks one iteration has."""

    def task_ids(self, split: str, iteration: int) -> list[str]:
        """The iteration's task ids of ``split``, the same on every rank."""

    def prompts_too_long(self, split: str) -> int:
        """How many ``split`` tasks the run leaves out for a prompt over rl.max_prompt_tokens."""

    def notes(self) -> list[str]:
        """Where the run does other than its configuration asks (a task file with fewer tasks
        than an iteration asks for), one sentence each: the master logs them once and writes
        them where ``status`` shows them."""

    def rollout_pipe(self, ctx: PhaseContext, split: str) -> RolloutPipe:
        """Where this rank's ``split`` rollout sends its tasks and takes back their records."""

    def metrics(self, ctx: PhaseContext, eval_records: Path) -> dict:
        """Eval metrics (at least ``accuracy``) from the iteration's merged eval records."""

    def train(self, ctx: PhaseContext, plan: TrainingPlan, checkpoint_dir: Path | None) -> None:
        """Run this rank's part of training ``plan``; the node of train worker 0 writes the
        checkpoint into ``checkpoint_dir`` (None on the others)."""

    def engine_start(self, ctx: PhaseContext) -> None: ...

    def engine_stop(self, ctx: PhaseContext) -> None: ...

    def close(self) -> None:
        """Stop whatever the workload still runs (the engine)."""


@dataclass(frozen=True, slots=True)
class RunView:
    """What a phase and its workload see of the run: its attempt, who is in it and where
    they run, the training round; and the few hooks into the rank they use. Never the
    coordinator itself."""

    attempt_id: str
    attempt: AttemptLayout
    in_run: Callable[[], tuple[Placement, frozenset[int]]]
    """The placement of the ranks in the run and the ranks it goes on without
    (coordination.elastic), as the latest barrier released them: a phase's decision, made
    at its barrier, sees that barrier's."""
    train_round: int
    """This iteration's try of training (a step redone without a lost rank is round 1, 2, ...)."""
    backoff: Backoff
    lost: Callable[[], frozenset[int]]
    """Master: the ranks marked out by now, also since the phase started (elastic)."""
    position: Callable[[], tuple[int | None, Phase | None]]
    """Where the rank is now (a kept-alive trainer fails in whatever phase the rank is in)."""
    fault_point: Callable[[str, int, Phase], None]
    """Where a test's ORCHESTRATOR_FAULT may hold the rank or make it fail."""
    timing: Callable[..., None]
    """``timing(part, seconds, **fields)``: how long a part of the phase's work took."""
    took: Callable[[str, int, int, int], None]
    """``took(split, chunk, tasks, victim)``: this rank took another rank's chunk."""
    progress: Callable[[int, int], None]
    """``progress(done, total)``: what the heartbeat says of the phase's work."""
    verdict_s: float = 0.0
    """How long after a node dies its death is named to every rank at the latest (the
    monitors' verdict, coordination.node_timeout_s and the intervals; with elastic, the
    workers' grace): how long to wait for that before blaming what died with it."""

    @property
    def placement(self) -> Placement:
        return self.in_run()[0]

    @property
    def out(self) -> frozenset[int]:
        return self.in_run()[1]


@dataclass(slots=True)
class PhaseContext:
    config: RunConfig
    layout: RunLayout
    iteration: int
    phase: Phase
    plan: dict
    cancel: CancelToken
    workload: Workload
    run: RunView
    log: logging.Logger
    policy: Checkpoint
    """The policy the run has published, as the latest release said (the base model at first)."""
    training: TrainingPlan | None = None
    """This iteration's training plan, once phase 9 released it (until its checkpoint is published)."""

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def is_master(self) -> bool:
        return self.config.rank == 0

    @property
    def attempt_id(self) -> str:
        return self.run.attempt_id

    @property
    def it(self) -> IterationLayout:
        return self.layout.iteration(self.iteration)

    def share(self, split: str) -> tuple[int, int]:
        """(offset, count) of this rank's slice of the iteration's ``split`` tasks."""
        per_rank = self.plan[split]["per_rank"]  # a rank beyond the plan's (a resume on more nodes) has none
        return sum(per_rank[: self.rank]), per_rank[self.rank] if self.rank < len(per_rank) else 0

    def progress(self, done: int, total: int) -> None:
        self.run.progress(done, total)

    def fault_point(self, action: str) -> None:
        """A test's fault hook at this phase (``hold-after-batch``, ``hold-in-removal``, ...)."""
        self.run.fault_point(action, self.iteration, self.phase)
