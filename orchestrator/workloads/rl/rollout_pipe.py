"""The RL rollout's pipe: the phase submits chunks of tasks, the engines answer requests in
flight (``inflight.py``), and the phase takes back scored records in batches it makes
durable, the way it always has: a batch is at least ``BATCH_TASKS`` tasks, or what came
within ``BATCH_WAIT_S`` of its first answer, or the last of the work.
"""

from __future__ import annotations

import random
import time
from typing import Callable

from orchestrator.runtime.context import PhaseContext
from orchestrator.workloads.rl.inflight import Answer, Inflight, Request
from orchestrator.workloads.rl.scoring import Scorer

BATCH_TASKS = 16
"""Records fsynced together: what one request carried before requests were this small."""
BATCH_WAIT_S = 0.5
"""The longest a completed record waits for others before its batch is made durable."""


class RLRolloutPipe:
    """One rollout (or eval) of one rank: ``submit`` task ids, take ``next_batch``es of
    scored records, ``close``. ``record(task, prompt, group, seconds)`` makes a task's record."""

    def __init__(self, ctx: PhaseContext, split: str, start: Callable[[], Inflight], scorer: Scorer, texts: dict[str, str],
                 tasks: dict[str, dict], record: Callable[..., dict], *, prompts_per_request: int):
        """``start()`` makes the engines' :class:`Inflight` when the first task comes: a rank
        with nothing to roll out (no engines on its node) starts none."""
        self.ctx, self.split = ctx, split
        self.prompts_per_request = prompts_per_request
        self._start = start
        self.inflight: Inflight | None = None
        self.scorer = scorer
        self._texts, self._tasks, self._record = texts, tasks, record
        self.outstanding = 0
        """Tasks submitted whose records were not returned yet."""
        self._ready: list[dict] = []
        self._since: float | None = None  # when the oldest record of _ready came

    def wants_more(self) -> bool:
        """True while the engines could take more than is waiting to be sent: then the phase
        claims another chunk (late, so that other ranks can still steal what is not begun)."""
        return self.inflight is None or self.inflight.queued_sequences < self.inflight.capacity

    def submit(self, task_ids: list[str]) -> None:
        seeds = random.Random  # one stream per request, named by its first task: the same whatever else is in flight
        ctx = self.ctx
        requests = []
        for i in range(0, len(task_ids), self.prompts_per_request):
            ids = task_ids[i : i + self.prompts_per_request]
            seed = seeds(f"{ctx.config.seed}:{self.split}:{ctx.iteration}:{ids[0]}").randrange(2**31)
            requests.append(Request(ids, [self._texts[t] for t in ids], seed))
        self.outstanding += len(task_ids)
        if self.inflight is None:
            self.inflight = self._start()
        self.inflight.submit(requests)

    def next_batch(self, timeout_s: float) -> list[dict]:
        """Scored records ready to be made durable, or [] when none are yet (after waiting up
        to ``timeout_s``). Raises an engine's failure, or RewardFailed before the batch is
        returned (it is never written)."""
        for answer in self.inflight.answers(timeout_s) if self.inflight else ():
            if self._since is None:
                self._since = time.monotonic()
            self._ready.extend(self._records(answer))
        due = self._since is not None and time.monotonic() - self._since >= BATCH_WAIT_S
        if not self._ready or not (len(self._ready) >= BATCH_TASKS or due or len(self._ready) == self.outstanding):
            return []
        batch, self._ready, self._since = self._ready, [], None
        self.scorer.check(batch)
        self.outstanding -= len(batch)
        return batch

    def _records(self, answer: Answer) -> list[dict]:
        return [self._record(self.ctx, self.split, self._tasks[t], prompt, group, answer.seconds, self.scorer,
                             sent_at=answer.sent_at)
                for t, prompt, group in zip(answer.request.task_ids, answer.request.prompts, answer.groups)]

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.close()
