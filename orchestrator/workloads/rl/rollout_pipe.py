"""The RL rollout's pipe: the phase submits chunks of tasks, the engines answer requests in
flight (``inflight.py``), and the phase takes back scored records in batches it makes
durable, the way it always has: a batch is at least ``BATCH_TASKS`` tasks, or what came
within ``BATCH_WAIT_S`` of its first answer, or the last of the work.

With ``rollout.partial`` the pipe continues the groups the last rollout carried
(``data/carry.py``): each unfinished sample a request of its own, its prompt the task's prompt
ids and the ids it sampled so far; and :meth:`RLRolloutPipe.stop` ends the rollout early,
every group not finished returned as it stands.

With ``rl.environment`` the records come from multi-turn episodes instead
(:class:`MultiTurnPipe`, ``episodes.py``): a task's record once all its samples have ended.

A complete record may pass through stages before it is returned, each a model beside the
policy asked on its own engines: with the judge's reward (``judge.py``) each sample's reward is
the judge's verdict; with ``rl.teacher`` a train record is scored by the teacher
(``teacher.py``): each sample gets ``teacher_logprobs``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import time
from typing import Callable, Protocol

from orchestrator.data import carry
from orchestrator.engine.client import Completion
from orchestrator.runtime.context import PhaseContext
from orchestrator.workloads.rl.episodes import Episodes
from orchestrator.workloads.rl.engine_requests import Answer, Inflight, Request, drain
from orchestrator.workloads.rl.scoring import Scorer

BATCH_TASKS = 16
"""Records fsynced together: what one request carried before requests were this small."""
BATCH_WAIT_S = 0.5
"""The longest a completed record waits for others before its batch is made durable."""
STOP_TIMEOUT_S = 120.0
"""The longest :meth:`RLRolloutPipe.stop` waits for the engines to answer what they were stopped in."""


class Stage(Protocol):
    """A model beside the policy that completes a record: the judge, the teacher."""

    def submit(self, record: dict) -> concurrent.futures.Future: ...

    def close(self) -> None: ...


class RLRolloutPipe:
    """One rollout (or eval) of one rank: ``submit`` task ids, take ``next_batch``es of
    scored records, ``close``. ``record(ctx, split, task, prompt, prompt_ids, samples, seconds,
    sent_at=...)`` makes a task's record of its samples."""

    def __init__(self, ctx: PhaseContext, split: str, start: Callable[[], Inflight], scorer: Scorer, texts: dict[str, str],
                 tasks: dict[str, dict], record: Callable[..., dict], *, prompts_per_request: int,
                 carried: dict[str, dict] | None = None, max_tokens: int = 0, stages: list[Callable[[], Stage]] = ()):
        """``start()`` makes the engines' :class:`Inflight` when the first task comes: a rank
        with nothing to roll out (no engines on its node) starts none. ``carried``: the groups
        the last rollout carried, by task id (their records), continued when submitted; their
        samples have what is left of ``max_tokens``. ``stages``: each makes a :class:`Stage`
        after ``start()``; a complete record passes through them in turn before it is
        returned. A ``scorer`` without a reward leaves the samples to a stage (the judge)."""
        self.ctx, self.split = ctx, split
        self._stage_starts, self.stages = list(stages), []
        self._scoring: list[concurrent.futures.Future] = []  # complete records in the stages
        self._carried, self._max_tokens = carried or {}, max_tokens
        self._continuing: dict[str, dict] = {}  # a carried task's record, its samples as they are now
        self._left: dict[str, int] = {}  # a carried task's samples still out
        self._came: list[dict] = []  # carried records complete as they came
        self._stopping = False  # in this rollout's own stop: an unfinished sample is kept as it stands
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
        requests = [r for t in task_ids if self._tokens(t) for r in self._continue(self._carried[t])]
        fresh = [t for t in task_ids if not self._tokens(t)]
        for i in range(0, len(fresh), self.prompts_per_request):
            ids = fresh[i : i + self.prompts_per_request]
            seed = seeds(f"{ctx.config.seed}:{self.split}:{ctx.iteration}:{ids[0]}").randrange(2**31)
            requests.append(Request(ids, [self._texts[t] for t in ids], seed))
        self.outstanding += len(task_ids)
        self._started()
        self.inflight.submit(requests)

    def _started(self) -> None:
        """The engines' in-flight budget (and the stages', each its model's), made with the first task."""
        if self.inflight is None:
            self.inflight = self._start()
            self.stages = [start() for start in self._stage_starts]

    def _tokens(self, task_id: str) -> bool:
        """Whether ``task_id`` is a carried group with samples begun (one never sent is rolled out anew)."""
        record = self._carried.get(task_id)
        return bool(record and record["samples"])

    def _continue(self, record: dict) -> list[Request]:
        """The requests that continue a group's unfinished samples (none: it is complete)."""
        task_id = record["task_id"]
        self._continuing[task_id] = {**record, "samples": list(record["samples"])}
        out = [r for j, s in enumerate(record["samples"]) if carry.unfinished(s) for r in self._continue_sample(task_id, j)]
        self._left[task_id] = len(out)
        if not out:
            self._came.append(self._finish(task_id, 0.0, time.time()))
        return out

    def _continue_sample(self, task_id: str, j: int) -> list[Request]:
        """The request that continues sample ``j`` of a group in hand (none: it reached the limit)."""
        record = self._continuing[task_id]
        s = record["samples"][j]
        left = self._max_tokens - len(s["token_ids"])
        if left <= 0:  # stopped as it reached the limit: it is finished
            record["samples"][j] = {**s, "finish_reason": "length"}
            return []
        seed = random.Random(f"{self.ctx.config.seed}:{self.split}:{self.ctx.iteration}:{task_id}:{j}:{len(s['token_ids'])}")
        return [Request([task_id], [record["prompt_token_ids"] + s["token_ids"]], seed.randrange(2**31), n=1, max_tokens=left, part=j)]

    @property
    def ready(self) -> int:
        """Records come and not yet returned in a batch (every one a finished group)."""
        return len(self._ready)

    def overdue(self, max_carry: int) -> bool:
        """Whether a group in hand was carried ``max_carry`` times: the rollout may not stop it."""
        return any(r.get("carried", 0) >= max_carry for r in list(self._continuing.values()))  # a copy: the loop may end one

    def stop(self, unsent: list[str]) -> list[dict]:
        """End the rollout now: the engines stop what they sample (their abort), and every
        task submitted and not returned yet comes back, a finished group as a record like any,
        an unfinished one as it stands (``unfinished``: its samples stopped with finish reason
        ``abort``; one never sent with none), and so do the ``unsent`` tasks (never submitted).
        Raises RewardFailed as :meth:`next_batch` does."""
        self._stopping = True
        withdrawn = self.inflight.stop(STOP_TIMEOUT_S) if self.inflight is not None else []
        self.outstanding += len(unsent)
        records = self._ready + self._take(0) + [self._untouched(t) for t in unsent]
        self._ready, self._since = [], None
        for request in withdrawn:
            if request.part is None:
                records += [self._untouched(t) for t in request.task_ids]
        records += [self._cut(t, record) for t, record in self._continuing.items()]
        records += [f.result(timeout=STOP_TIMEOUT_S) for f in self._scoring]  # complete: through the stages before they are written
        self._scoring.clear()
        self._continuing.clear()
        self._left.clear()
        self._stopping = False
        self.scorer.check(records)
        self.outstanding -= len(records)
        return records

    def _untouched(self, task_id: str) -> dict:
        """The record of a task stopped before it was sent: no samples; it is rolled out anew."""
        task = self._tasks[task_id]
        return {"task_id": task_id, "split": self.split, "iteration": self.ctx.iteration, "rank": self.ctx.rank,
                "unfinished": True, "prompt": self._texts.get(task_id, ""), "prompt_token_ids": None, "answer": task["answer"],
                "policy_iteration": self.ctx.policy.iteration, "samples": []} | {
                    k: self._carried[task_id][k] for k in ("carried", "origin_iteration") if k in self._carried.get(task_id, {})}

    def _cut(self, task_id: str, record: dict) -> dict:
        """A carried group stopped again (its samples as far as they got)."""
        return carry.with_versions({**record, "iteration": self.ctx.iteration, "rank": self.ctx.rank, "unfinished": True})

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
        """The records that came, waiting up to ``timeout_s`` for the first (with stages,
        those through them)."""
        came, self._came = self._came, []
        if came or self._scoring:
            timeout_s = min(timeout_s, 0.05) if self._scoring and not came else 0
        came += [r for answer in (self.inflight.answers(timeout_s) if self.inflight else ()) for r in self._records(answer)]
        return self._staged(came)

    def _staged(self, records: list[dict]) -> list[dict]:
        """``records`` as they are, or with stages those through them: a complete record is
        handed to them and comes back scored; an unfinished one goes once it is complete."""
        if not self.stages:
            return records
        out = [r for r in records if r.get("unfinished")]
        scoring, self._scoring = self._scoring + [self.inflight.spawn(self._through(r)) for r in records if not r.get("unfinished")], []
        for f in scoring:  # one look at each: one the loop's thread finishes meanwhile is taken next time, not lost
            if f.done():
                out.append(f.result())
            else:
                self._scoring.append(f)
        return out

    async def _through(self, record: dict) -> dict:
        """``record`` through each stage in turn (on the rollout's loop, each stage's requests on its own)."""
        for stage in self.stages:
            record = await asyncio.wrap_future(stage.submit(record))
        return record

    def _records(self, answer: Answer) -> list[dict]:
        if answer.request.part is not None:
            return self._continued(answer)
        out = []
        for t, prompt, group in zip(answer.request.task_ids, answer.request.prompts, answer.groups):
            record = self._record(self.ctx, self.split, self._tasks[t], prompt, group[0].prompt_token_ids,
                                  [self._sample(self._tasks[t], c) for c in group], answer.seconds, sent_at=answer.sent_at)
            if t in self._carried:  # carried before it was sent
                record |= {k: self._carried[t][k] for k in ("carried", "origin_iteration") if k in self._carried[t]}
            if any(map(carry.unfinished, record["samples"])):
                record = carry.with_versions(record | {"unfinished": True})
                if not self._stopping:  # stopped by another rank's stop of an engine they share: it goes on now
                    self.inflight.submit(self._continue(record))
                    continue
            out.append(record)
        return out

    def _continued(self, answer: Answer) -> list[dict]:
        """A carried sample's continuation came: the group's record once its last one has."""
        task_id, j = answer.request.task_ids[0], answer.request.part
        record = self._continuing[task_id]
        c = answer.groups[0][0]
        more = {"text": c.text, "token_ids": c.token_ids, "logprobs": c.token_logprobs, "finish_reason": c.finish_reason}
        record["samples"][j] = carry.continued(record["samples"][j], more, self.ctx.policy.iteration)
        if carry.unfinished(record["samples"][j]):
            if not self._stopping:  # another rank's stop of an engine they share: it goes on now
                self.inflight.submit(self._continue_sample(task_id, j))
            return []  # (the rollout's own stop: the group is cut as it stands)
        self._left[task_id] -= 1
        if self._left[task_id]:
            return []
        return [self._finish(task_id, answer.seconds, answer.sent_at)]

    def _finish(self, task_id: str, seconds: float, sent_at: float) -> dict:
        """A carried group's record, its last sample finished: scored as one rolled out whole."""
        record = self._continuing.pop(task_id)
        del self._left[task_id]
        task = self._tasks[task_id]
        samples = [s if "reward" in s or self.scorer.reward is None else self._scored(task, s) for s in record["samples"]]
        made = self._record(self.ctx, self.split, task, record["prompt"], record["prompt_token_ids"], samples, seconds, sent_at=sent_at)
        return carry.with_versions(made | {k: record[k] for k in ("carried", "origin_iteration") if k in record})

    def _scored(self, task: dict, sample: dict) -> dict:
        reward, error = self.scorer.score(task, sample["text"])
        return {**sample, "reward": reward} | ({"reward_error": error} if error is not None else {})

    def _sample(self, task: dict, c: Completion) -> dict:
        if c.finish_reason == carry.ABORTED or self.scorer.reward is None:  # stopped: scored once it is finished; or by a stage
            return {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "logprobs": c.token_logprobs}
        reward, error = self.scorer.score(task, c.text)
        sample = {"text": c.text, "token_ids": c.token_ids, "reward": reward, "finish_reason": c.finish_reason,
                  "logprobs": c.token_logprobs}
        if error is not None:
            sample["reward_error"] = error
        return sample

    def close(self) -> None:
        if self.inflight is not None:
            self.inflight.close()
        for stage in self.stages:
            stage.close()


class MultiTurnPipe(RLRolloutPipe):
    """The pipe of a multi-turn rollout: each submitted task runs as an episode of ``samples``
    conversations (``episodes.py``, or an agent's calls: agents/runner.py, which runs alike)
    on the engines' event loop; its record comes when all of them have ended."""

    def __init__(self, ctx: PhaseContext, split: str, start: Callable[[], Inflight], scorer: Scorer, episodes: Episodes,
                 tasks: dict[str, dict], record: Callable[..., dict], *, samples: int, carried: dict[str, dict] | None = None,
                 stages: list[Callable[[], Stage]] = ()):
        super().__init__(ctx, split, start, scorer, {}, tasks, record, prompts_per_request=1, carried=carried, stages=stages)
        self.episodes, self.samples = episodes, samples
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # each task's future, as it ends

    def wants_more(self) -> bool:
        """True while the tasks in hand have fewer samples than the engines take at once, twice
        over: a sample waiting for its environment leaves its slot to another's turn."""
        return self.inflight is None or self.outstanding * self.samples < 2 * self.inflight.capacity

    def submit(self, task_ids: list[str]) -> None:
        self.outstanding += len(task_ids)
        self._started()
        for task_id in task_ids:
            if self._tokens(task_id):
                self._continuing[task_id] = self._carried[task_id]
            self.inflight.spawn(self._episode(self._tasks[task_id])).add_done_callback(self._done.put)

    async def _episode(self, task: dict) -> dict:
        """The task's record once its samples ended (a carried group's: continued, data/carry.py)."""
        began = time.monotonic()
        ctx = self.ctx
        seed = f"{ctx.config.seed}:{self.split}:{ctx.iteration}:{task['id']}"
        carried = self._carried.get(task["id"])
        try:
            if carried and carried["samples"]:
                prompt, prompt_ids, samples, sent_at = await self.episodes.resume(self.inflight, task, carried, seed=seed)
                samples = [{**s, "policy_versions": carry.extended(carry.versions(carried, old), carry.length(s) - carry.length(old),
                                                                   ctx.policy.iteration)} if carry.unfinished(old) else s
                           for old, s in zip(carried["samples"], samples)]
            else:
                prompt, prompt_ids, samples, sent_at = await self.episodes.run(self.inflight, task, n=self.samples, seed=seed)
        finally:
            self._continuing.pop(task["id"], None)
        if all(carry.unfinished(s) and not s["token_ids"] for s in samples):  # stopped before it began
            samples = []
        record = self._record(ctx, self.split, task, prompt, prompt_ids, samples, time.monotonic() - began, sent_at=sent_at)
        if carried:
            record |= {k: carried[k] for k in ("carried", "origin_iteration") if k in carried}
        if not samples or any(map(carry.unfinished, samples)):
            record["unfinished"] = True
        else:  # complete: through the stages (the teacher's log-probs recorded with it)
            record = await self._through(record)
        return carry.with_versions(record) if carried or record.get("unfinished") else record

    def stop(self, unsent: list[str]) -> list[dict]:
        """End the rollout now: the engines stop what they sample, every sample between its
        turns goes no further (one in an environment call finishes it first), and every task
        submitted and not returned yet comes back (a finished group as a record like any, one
        with a stopped sample ``unfinished``), and so do the ``unsent`` tasks."""
        self.episodes.stopping = True
        try:
            if self.inflight is not None:
                self.inflight.stop(STOP_TIMEOUT_S)
            self.outstanding += len(unsent)
            records = self._ready + [self._untouched(t) for t in unsent]
            self._ready, self._since = [], None
            deadline = time.monotonic() + STOP_TIMEOUT_S + 2 * self.episodes.timeout_s  # a call, then the close
            while len(records) < self.outstanding:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.outstanding - len(records)} multi-turn samples did not stop within "
                                       f"{STOP_TIMEOUT_S + 2 * self.episodes.timeout_s:g} s of the rollout's stop")
                records += self._take(1.0)
        finally:
            self.episodes.stopping = False
        self.scorer.check(records)
        self.outstanding -= len(records)
        return records

    def _take(self, timeout_s: float) -> list[dict]:
        """The records of the tasks that ended, waiting up to ``timeout_s`` for the first;
        raises an engine's failure."""
        return [future.result() for future in drain(self._done, timeout_s)]

    def close(self) -> None:
        self.episodes.close()  # first: an agent rollout stops its endpoint on the loop
        super().close()
