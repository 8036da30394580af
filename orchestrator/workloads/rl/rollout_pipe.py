"""The RL rollout's pipe: the phase submits chunks of tasks, the engines answer requests in
flight (``inflight.py``), and the phase takes back scored records in batches it makes
durable, the way it always has: a batch is at least ``BATCH_TASKS`` tasks, or what came
within ``BATCH_WAIT_S`` of its first answer, or the last of the work.

With ``rl.environment`` the records come from multi-turn episodes instead
(:class:`MultiTurnPipe`, ``episodes.py``): a task's record once all its samples have ended.
"""

from __future__ import annotations

import queue
import random
import time
from typing import Callable

from orchestrator.engine.client import Completion
from orchestrator.runtime.context import PhaseContext
from orchestrator.workloads.rl.episodes import Episodes
from orchestrator.workloads.rl.engine_requests import Answer, Inflight, Request, drain
from orchestrator.workloads.rl.scoring import Scorer

BATCH_TASKS = 16
"""Records fsynced together: what one request carried before requests were this small."""
BATCH_WAIT_S = 0.5
"""The longest a completed record waits for others before its batch is made durable."""


class RLRolloutPipe:
    """One rollout (or eval) of one rank: ``submit`` task ids, take ``next_batch``es of
    scored records, ``close``. ``record(ctx, split, task, prompt, prompt_ids, samples, seconds,
    sent_at=...)`` makes a task's record of its samples."""

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
        came = self._take(timeout_s)
        if came and self._since is None:
            self._since = time.monotonic()
        self._ready.extend(came)
        due = self._since is not None and time.monotonic() - self._since >= BATCH_WAIT_S
        if not self._ready or not (len(self._ready) >= BATCH_TASKS or due or len(self._ready) == self.outstanding):
            return []
        batch, self._ready, self._since = self._ready, [], None
        self.scorer.check(batch)
        self.outstanding -= len(batch)
        return batch

    def _take(self, timeout_s: float) -> list[dict]:
        """The records that came, waiting up to ``timeout_s`` for the first."""
        return [r for answer in (self.inflight.answers(timeout_s) if self.inflight else ()) for r in self._records(answer)]

    def _records(self, answer: Answer) -> list[dict]:
        return [self._record(self.ctx, self.split, self._tasks[t], prompt, group[0].prompt_token_ids,
                             [self._sample(self._tasks[t], c) for c in group], answer.seconds, sent_at=answer.sent_at)
                for t, prompt, group in zip(answer.request.task_ids, answer.request.prompts, answer.groups)]

    def _sample(self, task: dict, c: Completion) -> dict:
        reward, error = self.scorer.score(task, c.text)
        sample = {"text": c.text, "token_ids": c.token_ids, "reward": reward, "finish_reason": c.finish_reason,
                  "logprobs": c.token_logprobs}
        if error is not None:
            sample["reward_error"] = error
        return sample

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.close()


class MultiTurnPipe(RLRolloutPipe):
    """The pipe of a multi-turn rollout: each submitted task runs as an episode of ``samples``
    conversations (``episodes.py``, or an agent's calls: agents/runner.py, which runs alike)
    on the engines' event loop; its record comes when all of them have ended."""

    def __init__(self, ctx: PhaseContext, split: str, start: Callable[[], Inflight], scorer: Scorer, episodes: Episodes,
                 tasks: dict[str, dict], record: Callable[..., dict], *, samples: int):
        super().__init__(ctx, split, start, scorer, {}, tasks, record, prompts_per_request=1)
        self.episodes, self.samples = episodes, samples
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # each task's future, as it ends

    def wants_more(self) -> bool:
        """True while the tasks in hand have fewer samples than the engines take at once, twice
        over: a sample waiting for its environment leaves its slot to another's turn."""
        return self.inflight is None or self.outstanding * self.samples < 2 * self.inflight.capacity

    def submit(self, task_ids: list[str]) -> None:
        self.outstanding += len(task_ids)
        if self.inflight is None:
            self.inflight = self._start()
        for task_id in task_ids:
            self.inflight.spawn(self._episode(self._tasks[task_id])).add_done_callback(self._done.put)

    async def _episode(self, task: dict) -> dict:
        began = time.monotonic()
        ctx = self.ctx
        prompt, prompt_ids, samples, sent_at = await self.episodes.run(
            self.inflight, task, n=self.samples, seed=f"{ctx.config.seed}:{self.split}:{ctx.iteration}:{task['id']}")
        return self._record(ctx, self.split, task, prompt, prompt_ids, samples, time.monotonic() - began, sent_at=sent_at)

    def _take(self, timeout_s: float) -> list[dict]:
        """The records of the tasks that ended, waiting up to ``timeout_s`` for the first;
        raises an engine's failure."""
        return [future.result() for future in drain(self._done, timeout_s)]

    def close(self) -> None:
        self.episodes.close()  # first: an agent rollout stops its endpoint on the loop
        super().close()
