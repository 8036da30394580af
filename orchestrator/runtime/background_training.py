"""rl.max_staleness >= 1: phase 10's training runs on while the rank walks a later rollout.

The schedule (protocol/schedule.py) walks phase 10 of iteration i, then the rollout half of
a later iteration, then phase 11 of i. Phase 10 hands this node's part of the training to
the rank's training thread (the work itself is in the train worker processes; the thread
waits for them, as phase 10 does in lockstep), and phase 11 waits for it before the
checkpoint is published. Whatever ends the training ends the rank at once, wherever it is:
a failure cancels the rank's token, as a dead child does. A rank resumed between the two
phases has nothing in flight: phase 11 trains there and then (or finds the checkpoint made),
unless it was admitted back into the running attempt (elastic) after that training started
without it.

The thread lives as long as the rank: the train workers it starts get SIGKILL from the
kernel when the *thread* that started them ends (``PR_SET_PDEATHSIG``, node/procs.py), and
kept-alive trainers serve from one training to the next.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from orchestrator.errors import OrchestratorError
from orchestrator.phase_table import Phase
from orchestrator.protocol.waiting import Backoff, Deadline, poll
from orchestrator.runtime.context import PhaseContext

Work = Callable[[PhaseContext], object]


class TrainingFailed(OrchestratorError):
    """The training thread failed with an error of no kind of ours (its traceback follows)."""


class BackgroundTraining:
    def __init__(self, on_change: Callable[[int | None], None] = lambda _iteration: None) -> None:
        """``on_change(iteration)``: the iteration training in the background now (None: none),
        for the heartbeat, which `status` shows."""
        self._on_change = on_change
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._future: Future | None = None
        self._iteration: int | None = None
        self._rejoined = False
        """Admitted back into a running attempt, and no training launched since (elastic)."""

    @property
    def pending(self) -> int | None:
        """The iteration launched and not yet finished (phase 11), None when none is."""
        return self._iteration

    def entered(self, *, rejoined: bool) -> None:
        """The rank enters an attempt's walk: at its start, or admitted back into it."""
        self.forget()
        self._rejoined = rejoined

    def launch(self, ctx: PhaseContext, work: Work) -> None:
        """Phase 10: hand ``work`` (this node's part of the training) to the training thread.
        Its hooks say phase 10 of its iteration whatever the rank walks meanwhile."""
        here = (ctx.iteration, Phase.TRAIN)
        run = dataclasses.replace(ctx.run, position=lambda: here, timing=functools.partial(ctx.run.timing, at=here))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="training", daemon=True)
            self._thread.start()
        self._future, self._iteration, self._rejoined = Future(), ctx.iteration, False
        self._on_change(ctx.iteration)
        self._jobs.put((self._future, dataclasses.replace(ctx, run=run), work))

    def finish(self, ctx: PhaseContext, work: Work) -> None:
        """Phase 11: wait for the training of ``ctx.iteration`` (deadlines.train and publish
        bound the wait: the monitor cancels the rank), or run it here when none is in flight
        (the rank resumed after phase 10)."""
        future = self._future
        if future is None or self._iteration != ctx.iteration:
            if self._rejoined:
                ctx.log.info("iteration %d trains without this rank: it was admitted back after that training started",
                             ctx.iteration)
                return
            self.forget()
            ctx.log.info("no training of iteration %d in flight on this rank (resumed after phase 10): training it now",
                         ctx.iteration)
            work(ctx)
            return
        poll(lambda: True if future.done() else None, deadline=Deadline.never("the training thread"), cancel=ctx.cancel,
             backoff=Backoff(0.05, 0.25))
        self.forget()
        future.result()  # raises what the training raised

    def forget(self) -> None:
        """No training in flight any more (a new attempt: the old one's ends with its children)."""
        self._future, self._iteration = None, None
        self._on_change(None)

    def _serve(self) -> None:
        while True:
            future, ctx, work = self._jobs.get()
            try:
                work(ctx)
            except BaseException as e:  # noqa: BLE001 - handed to the rank, which reports it
                future.set_exception(e)
                ctx.cancel.cancel(e if isinstance(e, OrchestratorError) else _failed(ctx.iteration, e))
            else:
                future.set_result(None)
            if future is self._future:  # not a try a retrain replaced (its successor is in flight)
                self._on_change(None)


def _failed(iteration: int, e: BaseException) -> TrainingFailed:
    failed = TrainingFailed(f"training of iteration {iteration} failed: {type(e).__name__}: {e}")
    failed.__cause__ = e
    return failed
