"""Many requests in flight per engine, the way inference engines want to be fed.

An engine schedules by continuous batching: it wants every sequence it can fit, and refills
a slot the moment a sequence ends. So the rollout sends its prompts in requests of a few
(``rollout.prompts_per_request``) and keeps up to ``max_sequences`` sequences (prompts x
samples) outstanding on every engine: a request leaves as soon as one ends, and no
completion waits for another request's longest one. The requests go out from one asyncio event loop in a thread of its own, over one
pooled ``aiohttp.ClientSession`` per engine; the caller's thread submits work and takes the
answers as they come (:meth:`Inflight.answers`), in completion order. A multi-turn rollout
runs its samples as coroutines on that loop instead (:meth:`Inflight.spawn`), each awaiting its
turns' requests (:meth:`Inflight.complete`) under the same budget.

Requests to the engines of another node (a model beside the policy that only some nodes
serve) may fail over: an engine that stops answering is left out, its requests go to the
others, and only when none is left does the request fail (:class:`EnginesGone`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp

from orchestrator.engine.client import Completion, EngineClient, EngineUnavailable

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0
"""How long a rollout's request to an engine may take."""
_CLOSE_WAIT_S = 10.0  # how long close() waits for the loop's thread to end
_STOP_SETTLE_S = 0.05
"""How long stop() lets the requests just sent reach their engines before it pauses them: one
that reaches an engine paused is held there, and withdrawn."""
_STOP_QUIET_S = 0.5
"""stop() takes the answers of what a paused engine was sampling until none has come for this
long: an engine sends them at once, so what has not come by then is a request it holds for the
resume (an answer that would have come later only loses what it had sampled: the request
counts as never sent)."""


def drain(items: queue.SimpleQueue, timeout_s: float) -> list:
    """What ``items`` holds, waiting up to ``timeout_s`` for the first."""
    got = []
    try:
        got.append(items.get(timeout=timeout_s))
    except queue.Empty:
        return got
    while True:
        try:
            got.append(items.get_nowait())
        except queue.Empty:
            return got


class EnginesGone(EngineUnavailable):
    """Every engine of a failing-over Inflight stopped answering."""


class Stopped(Exception):
    """A coroutine's request that a stop (:meth:`Inflight.stop`) left unsent or withdrew: its
    sample ends where it is."""


@dataclass(frozen=True, slots=True)
class Request:
    task_ids: list[str]
    prompts: list[str] | list[list[int]]
    """Texts, or token-id prompts the engine continues as they are."""
    seed: int
    n: int | None = None
    """Samples a prompt; None: the Inflight's ``sampling["n"]``."""
    max_tokens: int | None = None
    """None: the Inflight's ``sampling["max_tokens"]``."""
    part: int | None = None
    """The sample of a carried task this request continues (partial rollouts); None: a new one."""
    score_from: int | None = None
    """A scoring request (rl.teacher's): the engine's log-probs of each prompt's ids from this
    position on, each group one :class:`Completion` holding them (``token_logprobs``) and those
    ids (``token_ids``); nothing is sampled. None: a completion request."""

    @property
    def size(self) -> int:
        return len(self.prompts)

    def overrides(self) -> dict:
        return {k: v for k, v in (("n", self.n), ("max_tokens", self.max_tokens)) if v is not None}


@dataclass(frozen=True, slots=True)
class Answer:
    request: Request
    groups: list[list[Completion]]
    """``groups[j]``: the samples of ``request.prompts[j]``."""
    seconds: float
    """The request's wall time, sent to answered."""
    sent_at: float
    """When it was sent (``time.time()``)."""


@dataclass(slots=True)
class _Engine:
    client: EngineClient
    timeout_s: float
    session: aiohttp.ClientSession | None = None
    """The engine's pool of connections, made when first used (on the loop)."""
    sequences: int = 0
    """Sequences of this engine's requests in flight now."""
    gone: bool = False
    """It stopped answering (failover): nothing more is sent to it."""

    def http(self) -> aiohttp.ClientSession:
        """The pool the next request goes through."""
        if self.session is None:
            self.session = self.client.async_http(self.timeout_s, keepalive_s=KEEPALIVE_S)
        return self.session


KEEPALIVE_S = 2.0
"""How long an idle connection to an engine stays in the pool."""


@dataclass(slots=True)
class Stats:
    peak_sequences: list[int] = field(default_factory=list)
    """Per engine, the most sequences it had in flight at once."""
    requests: int = 0


class Inflight:
    """Sends :class:`Request`s to ``clients`` with up to ``max_sequences`` sequences in flight
    on each engine (a request larger than that goes alone). ``sampling`` is the keyword
    arguments of :meth:`EngineClient.acomplete` (``n`` among them) shared by every request.

    ``failover``: an engine that cannot be reached is left out and its requests go to the
    others; when the last one goes, ``failover(error)`` is called off the loop (the caller
    waits there for the verdict on a node that died with it) and the request fails with
    :class:`EnginesGone` naming ``label``. None: the first failure fails the request."""

    def __init__(self, clients: Sequence[EngineClient], *, max_sequences: int, sampling: dict, timeout_s: float,
                 failover=None, label: str = "the engines"):
        if not clients:
            raise ValueError("no engines")
        self._failover = failover
        self._label = label
        self._verdict: asyncio.Future | None = None  # failover's call once the last engine went
        self.max_sequences = max_sequences
        self.samples = int(sampling.get("n", 1))
        self._sampling = sampling
        # The budget bounds the connections; an idle one is dropped before vLLM's server (uvicorn,
        # 5 s) would close it under a request (KEEPALIVE_S).
        self._engines = [_Engine(c, timeout_s) for c in clients]
        self.stats = Stats(peak_sequences=[0] * len(clients))
        # The loop's, not yet sent; with the future of a coroutine's request (None: to the answers queue).
        self._waiting: collections.deque[tuple[Request, asyncio.Future | None]] = collections.deque()
        self._answers: queue.SimpleQueue[Answer | BaseException] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # sequences submitted and not yet sent (guarded by _lock)
        self._failed = False
        self._halted = False  # stop(): nothing more is sent
        # The requests sent and not answered yet, by the task that sends each (with its future).
        self._sending: dict[asyncio.Task, tuple[Request, asyncio.Future | None]] = {}
        self._loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-inflight", daemon=True)
        self._thread.start()

    # -- the caller's thread ---------------------------------------------------------------

    def submit(self, requests: Sequence[Request]) -> None:
        with self._lock:
            self._queued += sum(self._sequences(r) for r in requests)
        self._loop.call_soon_threadsafe(self._enqueue, [(r, None) for r in requests])

    @property
    def capacity(self) -> int:
        """Sequences the engines hold in flight at once, all of them together."""
        return self.max_sequences * len(self._engines)

    def spawn(self, coroutine) -> concurrent.futures.Future:
        """Run ``coroutine`` on the loop (it may await :meth:`complete`); its future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _sequences(self, request: Request) -> int:
        return request.size * (request.n or self.samples)

    @property
    def queued_sequences(self) -> int:
        """Sequences submitted and not yet sent to an engine."""
        with self._lock:
            return self._queued

    def answers(self, timeout_s: float) -> list[Answer]:
        """The answers that came since the last call, waiting up to ``timeout_s`` for the
        first; raises the first request's failure (the rest are then left unsent)."""
        got = drain(self._answers, timeout_s)
        for item in got:
            if isinstance(item, BaseException):
                raise item
        return got

    def stop(self, timeout_s: float) -> list[Request]:
        """Stop the engines' work now: nothing more is sent, every engine is paused (its abort:
        each request in flight is answered at once with what it sampled, finish reason
        ``abort``; those answers are queued for :meth:`answers` like any), and resumed (free for
        eval). Returns the requests never sent, and those that reached an engine only after it
        paused (withdrawn); a coroutine's such request raises :class:`Stopped` in it instead."""
        future = asyncio.run_coroutine_threadsafe(self._halt(), self._loop)
        return future.result(timeout=timeout_s)

    def close(self) -> None:
        """Stop sending; requests in flight are abandoned (their answers are never taken)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop)
            self._thread.join(timeout=_CLOSE_WAIT_S)

    # -- the loop's thread -----------------------------------------------------------------

    async def complete(self, request: Request) -> Answer:
        """``request`` answered, sent when an engine has room (from a coroutine on the loop)."""
        with self._lock:
            self._queued += self._sequences(request)
        future = self._loop.create_future()
        self._enqueue([(request, future)])
        return await future

    async def _halt(self) -> list[Request]:
        self._halted = True
        unsent = [request for request, future in self._waiting if future is None]
        for _request, future in self._waiting:
            if future is not None and not future.done():
                future.set_exception(Stopped())
        self._waiting.clear()
        with self._lock:
            self._queued = 0
        clients = [e.client for e in self._engines]
        loop = asyncio.get_running_loop()
        if self._sending:  # a request sent a moment ago reaches its engine before the pause, not after
            await asyncio.sleep(_STOP_SETTLE_S)
        await loop.run_in_executor(None, lambda: [c.pause() for c in clients])
        try:
            # What an engine was sampling comes back at once; a request still on its way when its
            # engine paused waits there for the resume: it is withdrawn (the engine drops a request
            # whose client went away) and counts as never sent.
            held = set(self._sending)
            while held:  # the answers come at once, in a burst: what has not come once it is over is held
                _done, held = await asyncio.wait(held, timeout=_STOP_QUIET_S, return_when=asyncio.FIRST_COMPLETED)
                if not _done:
                    break
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            for task in held:
                request, future = self._sending.pop(task)
                if future is None:
                    unsent.append(request)
                elif not future.done():
                    future.set_exception(Stopped())
        finally:
            await loop.run_in_executor(None, lambda: [c.resume() for c in clients])
        return unsent

    async def _fail_over(self, engine: _Engine, request: Request, future: asyncio.Future | None,
                         error: EngineUnavailable) -> BaseException | None:
        """``engine`` stopped answering: leave it out and send ``request`` again to the others
        (None), or with none left, the failure to hand on."""
        if not engine.gone:
            engine.gone = True
            log.warning("%s at %s stopped answering (%s): its requests go to the others", self._label,
                        engine.client.base_url, error)
        if any(not e.gone for e in self._engines):
            with self._lock:
                self._queued += self._sequences(request)
            self._waiting.appendleft((request, future))
            self._dispatch()
            return None
        if self._verdict is None:  # the caller is told once, for every request that failed with the last engine
            self._verdict = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self._failover, error))
        try:
            await asyncio.shield(self._verdict)
        except asyncio.CancelledError:
            raise
        except BaseException as verdict:  # noqa: BLE001 - what the caller learnt meanwhile (a peer's failure) is the failure
            return verdict
        urls = ", ".join(e.client.base_url for e in self._engines)
        return EnginesGone(f"every engine of {self._label} stopped answering ({urls}); the last: {error}")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        try:
            await self._stopping.wait()
        finally:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for e in self._engines:
                if e.session is not None:
                    await e.session.close()

    def _stop(self) -> None:
        self._stopping.set()

    def _enqueue(self, requests: list[tuple[Request, asyncio.Future | None]]) -> None:
        self._waiting.extend(requests)
        self._dispatch()

    def _dispatch(self) -> None:
        """Send waiting requests while some engine has room: the least loaded one first."""
        while self._waiting and not self._failed and not self._halted:
            request, future = self._waiting[0]
            sequences = self._sequences(request)
            engine = min((e for e in self._engines if not e.gone), key=lambda e: e.sequences, default=None)
            if engine is None:  # failover left none: the request that found so fails (_fail_over)
                return
            if engine.sequences and engine.sequences + sequences > self.max_sequences:
                return
            self._waiting.popleft()
            with self._lock:
                self._queued -= sequences
            engine.sequences += sequences
            i = self._engines.index(engine)
            self.stats.peak_sequences[i] = max(self.stats.peak_sequences[i], engine.sequences)
            self.stats.requests += 1
            task = self._loop.create_task(self._send(engine, request, sequences, future))
            self._sending[task] = (request, future)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        if not task.cancelled():  # a withdrawn one stays for _halt to hand back
            self._sending.pop(task, None)

    async def _send(self, engine: _Engine, request: Request, sequences: int, future: asyncio.Future | None) -> None:
        began, sent_at = time.monotonic(), time.time()
        try:
            if request.score_from is not None:
                scored = await engine.client.aprompt_logprobs(engine.http(), request.prompts, start=request.score_from)
                groups = [[Completion("", "length", logprobs, None, list(prompt[request.score_from:]), list(prompt))]
                          for prompt, logprobs in zip(request.prompts, scored)]
            else:
                groups = await engine.client.acomplete(engine.http(), request.prompts, seed=request.seed,
                                                       **(self._sampling | request.overrides()))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which raises it
            engine.sequences -= sequences
            sequences = 0  # freed now: the request may go to another engine before ``finally``
            if self._failover is not None and isinstance(e, EngineUnavailable):
                e = await self._fail_over(engine, request, future, e)
                if e is None:
                    return
            self._failed = True
            if future is None:
                self._answers.put(e)
            elif not future.done():
                future.set_exception(e)
            return
        finally:
            engine.sequences -= sequences
        answer = Answer(request, groups, time.monotonic() - began, sent_at)
        if future is None:
            self._answers.put(answer)
        elif not future.done():
            future.set_result(answer)
        self._dispatch()
