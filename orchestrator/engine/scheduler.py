"""Continuous batching for the embedded engine: one thread owns the :class:`Sampler` (its
model and its tokenizer) and batches across requests, as vLLM does.

HTTP handler threads :meth:`Scheduler.submit` a request and wait on its future. Before each
decoding step the scheduler admits the requests that arrived meanwhile, in arrival order,
while the running batch holds at most ``max_num_seqs`` sequences (a larger request runs
alone): their prompts are prefilled together and their rows join the running batch. Each
step samples one token for every running row; rows that end leave the batch at once, and a
request's future is answered in the step its last row ends.

:meth:`Scheduler.between_steps` queues a call (a weight reload) behind the requests already
queued: admission stops at it, the running batch drains, the call runs alone on the
scheduler thread, and admission resumes. So a request runs on one set of weights from its
prefill to its last token, and requests queued behind the call see what it changed.

:meth:`Scheduler.pause` stops admitting requests until :meth:`Scheduler.resume` (as vLLM's
``/pause`` and ``/resume``): by default every request not answered yet, running or queued,
is answered at once with what it has sampled (finish reason ``abort``: a queued one has no
tokens); with ``wait_for_inflight_requests`` the running ones finish first. Requests that come
while paused wait; calls between steps still run (pause, reload, resume).

Errors stay with their request: one refused at admission, too long for the context, or whose
response cannot be built fails alone; only a failed forward pass over the whole batch fails
every request in it. Stopping answers every request not yet answered with EngineStopped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Protocol, Sequence

from orchestrator.engine.sampling import Batch, Generation, Request, Sampler, SamplingParams

log = logging.getLogger("orchestrator.engine.scheduler")


class EngineStopped(Exception):
    """The engine stopped (shut down, or its scheduler failed) before answering."""


class Job(Protocol):
    """A completion request as the scheduler runs it; both methods run on the scheduler thread."""

    prompts: list[str]
    params: SamplingParams

    def admit(self) -> None:
        """Called just before the request joins the batch; raising refuses it (the exception
        becomes its future's)."""

    def finish(self, generation: Generation) -> object:
        """Called once every sample has ended, where the tokenizer may be used; the result is
        its future's."""


@dataclasses.dataclass(slots=True)
class GenerationJob:
    """A job whose future's result is its :class:`Generation`."""

    prompts: list[str]
    params: SamplingParams

    def admit(self) -> None:
        pass

    def finish(self, generation: Generation) -> Generation:
        return generation


@dataclasses.dataclass(slots=True)
class _Entry:
    """A queued request, or a call to run between two steps."""

    future: Future
    job: Job | None = None
    call: Callable[[], object] | None = None

    @property
    def sequences(self) -> int | None:
        """Rows the request adds to the batch; None for a call."""
        return None if self.job is None else len(self.job.prompts) * self.job.params.n


@dataclasses.dataclass(slots=True)
class Stats:
    """What the scheduler has done so far (``GET /stats`` on the server)."""

    steps: int = 0
    """Decoding steps run."""
    requests: int = 0
    """Requests admitted."""
    joined_running: int = 0
    """Requests admitted while other requests' rows were decoding: batching across requests."""
    peak_requests: int = 0
    """The most requests with rows in one step."""
    peak_sequences: int = 0
    """The most rows in one step."""
    prompt_tokens: int = 0
    """Tokens of the admitted rows' prompts (a request's prompt counted once a sample)."""
    prefill_tokens: int = 0
    """Tokens the prefills ran: a prompt continued by several rows, a request's ``n`` or
    requests admitted together with the same prompt ids, runs once (``Sampler.prefill``)."""
    busy_s: float = 0.0
    """Seconds the scheduler thread spent admitting requests and stepping (idle: waiting for work)."""
    running_requests: int = 0
    running_sequences: int = 0
    waiting: int = 0
    """Queued requests and calls, not admitted yet."""
    paused: bool = False
    aborted: int = 0
    """Requests answered unfinished by a pause."""


def admissions(waiting: Sequence[int | None], running: int, max_num_seqs: int) -> int:
    """How many entries at the head of the queue join the batch now.

    ``waiting`` holds each queued entry's sequence count, or None for a call between steps;
    ``running`` is the batch's sequence count. Requests join in arrival order while the batch
    stays within ``max_num_seqs`` sequences, except that one larger than that joins an empty
    batch alone; none joins past a call, which waits until the batch has drained.
    """
    count = 0
    for sequences in waiting:
        if sequences is None or (running and running + sequences > max_num_seqs):
            break
        running += sequences
        count += 1
    return count


@dataclasses.dataclass(slots=True)
class _Pauses:
    """Pause calls the scheduler thread takes up together, and the requests they answer unstarted."""

    calls: list[tuple[Future, bool]]
    queued: list[_Entry] = dataclasses.field(default_factory=list)

    @property
    def abort(self) -> bool:
        return any(abort for _, abort in self.calls)


class Scheduler:
    """Continuous batching over ``sampler``, on a thread of its own (the module's docstring
    says how); every other thread only submits work and reads :meth:`stats`."""

    def __init__(self, sampler: Sampler, *, max_num_seqs: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.sampler = sampler
        self.max_num_seqs = max_num_seqs
        self._cond = threading.Condition()
        self._queue: collections.deque[_Entry] = collections.deque()  # under _cond
        self._stopping = False  # under _cond
        self._paused = False  # under _cond
        self._pauses: list[tuple[Future, bool]] = []  # under _cond: pause calls not taken up yet, and whether each aborts
        self._stats = Stats()  # under _cond
        self._draining: list[Future] = []  # the scheduler thread's: pauses answered once the batch is empty
        # The scheduler thread's alone:
        self._batch = Batch()
        self._running: dict[Request, _Entry] = {}
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> Future:
        """Queue ``job``; its future gets ``job.finish``'s result, or the exception that
        refused or failed it (sampling.PromptRejected among them). Raises EngineStopped once
        stopping."""
        return self._enqueue(_Entry(Future(), job=job))

    def between_steps(self, call: Callable[[], object]) -> Future:
        """Run ``call`` on the scheduler thread once every request queued before it has been
        answered, and before any request queued after it is admitted; its future gets the
        result or the exception. Raises EngineStopped once stopping."""
        return self._enqueue(_Entry(Future(), call=call))

    def pause(self, *, wait_for_inflight_requests: bool = False) -> Future:
        """Stop admitting requests until :meth:`resume`; the future is answered once nothing
        runs: at once, every request not answered yet answered with what it has (finish
        reason ``abort``), or, with ``wait_for_inflight_requests``, once the running ones
        finished (the queued ones wait). Raises EngineStopped once stopping."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._paused = True
            self._pauses.append((future, not wait_for_inflight_requests))
            self._cond.notify()
        return future

    def resume(self) -> None:
        """Admit requests again (those that came while paused first, in order)."""
        with self._cond:
            self._paused = False
            self._cond.notify()

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    def _enqueue(self, entry: _Entry) -> Future:
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._queue.append(entry)
            self._cond.notify()
        return entry.future

    def stop(self, timeout_s: float) -> None:
        """Stop after the current step: every request not answered yet gets EngineStopped.
        Waits up to ``timeout_s`` for the scheduler thread (a daemon: it cannot hold up the
        process's exit beyond that)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the scheduler is still in a step after %.1fs; exiting without it", timeout_s)

    def stats(self) -> Stats:
        with self._cond:
            return dataclasses.replace(self._stats, waiting=len(self._queue), paused=self._paused,
                                       prompt_tokens=self.sampler.prompt_tokens, prefill_tokens=self.sampler.prefill_tokens)

    # -- the scheduler thread --------------------------------------------------------------------

    def _run(self) -> None:
        reason = "the engine is shutting down"
        try:
            while (work := self._next()) is not None:
                admitted, call = work
                if isinstance(admitted, _Pauses):
                    self._pause(admitted)
                    continue
                if call is not None:
                    self._call(call)
                    continue
                began = time.monotonic()
                if admitted:
                    self._admit(admitted)
                if self._batch:
                    self._step()
                self._answer_drained()
                with self._cond:
                    self._stats.busy_s += time.monotonic() - began
        except BaseException as e:
            log.exception("the scheduler failed")
            reason = f"the engine's scheduler failed: {type(e).__name__}: {e}"
            raise
        finally:
            with self._cond:
                self._stopping = True
                left = [*self._queue, *self._running.values()]
                self._queue.clear()
                pauses = [future for future, _ in self._pauses] + self._draining
                self._pauses, self._draining = [], []
            self._running.clear()
            self._batch = Batch()
            for entry in left:
                entry.future.set_exception(EngineStopped(reason))
            for future in pauses:
                future.set_exception(EngineStopped(reason))

    def _next(self) -> tuple[list[_Entry] | _Pauses, _Entry | None] | None:
        """What to do next: (requests to admit, None), ([], a call to run), or (pauses to
        take up, None); None to stop. Waits while there is nothing to do. While paused no
        request is admitted, and a call runs once the batch is empty, before the requests
        that wait for the resume."""
        with self._cond:
            while not self._stopping and not self._pauses and not self._batch and not self._ready():
                self._cond.wait()
            if self._stopping:
                return None
            if self._pauses:
                pauses = _Pauses(self._pauses)
                self._pauses = []
                if pauses.abort:  # the queued requests are answered too, unstarted
                    pauses.queued = [e for e in self._queue if e.job is not None]
                    self._queue = collections.deque(e for e in self._queue if e.job is None)
                return pauses, None
            if self._paused:
                call = next((e for e in self._queue if e.call is not None), None) if not self._batch else None
                if call is not None:
                    self._queue.remove(call)
                return [], call
            if self._queue and self._queue[0].call is not None and not self._batch:
                return [], self._queue.popleft()
            count = admissions([e.sequences for e in self._queue], len(self._batch), self.max_num_seqs)
            return [self._queue.popleft() for _ in range(count)], None

    def _ready(self) -> bool:
        """Something queued can run now (under _cond)."""
        return any(e.call is not None for e in self._queue) if self._paused else bool(self._queue)

    def _pause(self, pauses: _Pauses) -> None:
        """Take up pause calls: abort what runs and what was queued, or let the batch drain."""
        if pauses.abort:
            aborted = list(self._running.items())
            self._running.clear()
            self.sampler.abort(self._batch, [request for request, _ in aborted])
            for entry in pauses.queued:
                try:
                    request = self.sampler.request(entry.job.prompts, entry.job.params)
                except Exception as e:  # a prompt it would have refused at admission
                    entry.future.set_exception(e)
                    continue
                self.sampler.abort(self._batch, [request])  # not in the batch: only its empty generation
                aborted.append((request, entry))
            for request, entry in aborted:
                try:
                    entry.future.set_result(entry.job.finish(request.generation))
                except Exception as e:
                    entry.future.set_exception(e)
            with self._cond:
                self._stats.aborted += len(aborted)
                self._stats.running_requests = self._stats.running_sequences = 0
        self._draining.extend(future for future, _ in pauses.calls)
        self._answer_drained()

    def _answer_drained(self) -> None:
        """Answer the pauses that wait for the batch to drain, once it has."""
        if self._draining and not self._batch:
            for future in self._draining:
                future.set_result(None)
            self._draining = []

    def _call(self, entry: _Entry) -> None:
        try:
            entry.future.set_result(entry.call())
        except Exception as e:
            entry.future.set_exception(e)

    def _admit(self, entries: list[_Entry]) -> None:
        requests = []
        for entry in entries:
            try:
                entry.job.admit()
                request = self.sampler.request(entry.job.prompts, entry.job.params)
            except Exception as e:
                entry.future.set_exception(e)
                continue
            requests.append(request)
            self._running[request] = entry
        if not requests:
            return
        try:
            joining = self.sampler.prefill(requests)
        except Exception as e:  # the running batch is untouched: only the newcomers fail
            log.exception("prefilling %d request(s) failed", len(requests))
            for request in requests:
                self._running.pop(request).future.set_exception(e)
            return
        with self._cond:
            self._stats.requests += len(requests)
            if self._batch:
                self._stats.joined_running += len(requests)
        self._batch.join(joining)

    def _step(self) -> None:
        with self._cond:
            s = self._stats
            s.steps += 1
            s.running_requests, s.running_sequences = len(self._running), len(self._batch)
            s.peak_requests = max(s.peak_requests, len(self._running))
            s.peak_sequences = max(s.peak_sequences, len(self._batch))
        try:
            finished = self.sampler.step(self._batch)
        except Exception as e:  # the batch's state is unknown now: every request in it fails
            log.exception("a decoding step over %d request(s) failed", len(self._running))
            for entry in self._running.values():
                entry.future.set_exception(e)
            self._running.clear()
            self._batch = Batch()
            return
        for request in finished:
            entry = self._running.pop(request)
            try:
                entry.future.set_result(entry.job.finish(request.generation))
            except Exception as e:
                entry.future.set_exception(e)
        if not self._batch:
            with self._cond:
                self._stats.running_requests = self._stats.running_sequences = 0
