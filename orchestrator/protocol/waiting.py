"""Deadlines, cancellation, polling with backoff and bounded retries: every wait and every
retry in the project goes through ``poll`` or ``retry`` here."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

from orchestrator.errors import DeadlineExceeded, OrchestratorError
from orchestrator.protocol.clock import REAL_CLOCK, Clock

T = TypeVar("T")
log = logging.getLogger(__name__)


class CancelToken:
    """Set once, by whoever first learns the rank must stop; every wait checks it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: OrchestratorError | None = None
        self._lock = threading.Lock()
        self._wakes: set[threading.Event] = set()

    def cancel(self, reason: OrchestratorError) -> bool:
        """Record ``reason`` unless a reason is already set; True if this call set it."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            self._event.set()
            for wake in self._wakes:
                wake.set()
            return True

    @property
    def reason(self) -> OrchestratorError | None:
        return self._reason

    def check(self) -> None:
        if self._reason is not None:
            raise self._reason

    def sleep(self, seconds: float, wake: threading.Event | None = None) -> None:
        """Sleep, but wake and raise at once if the token is cancelled; and return early
        when ``wake`` is set (a same-host wake-up: coordination/wakeup.py), clearing it."""
        if wake is None:
            if self._event.wait(max(0.0, seconds)):
                raise self._reason  # type: ignore[misc]
            return
        with self._lock:
            self._wakes.add(wake)
        try:
            if self._reason is None:
                wake.wait(max(0.0, seconds))
        finally:
            with self._lock:
                self._wakes.discard(wake)
            wake.clear()
        self.check()


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point on a monotonic clock (this process's, or a test's fake one), with what to say
    when it passes."""

    at: float
    what: str
    clock: Clock = REAL_CLOCK

    @classmethod
    def after(cls, seconds: float, what: str, clock: Clock = REAL_CLOCK) -> "Deadline":
        return cls(clock.monotonic() + seconds, what, clock)

    @classmethod
    def never(cls, what: str) -> "Deadline":
        """For a wait another mechanism bounds (the monitor's phase deadline, a child's death)."""
        return cls(float("inf"), what)

    def extended(self, seconds: float) -> "Deadline":
        return Deadline(self.at + seconds, self.what, self.clock)

    def remaining(self) -> float:
        return self.at - self.clock.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


@dataclass(frozen=True, slots=True)
class Backoff:
    """Poll intervals: start at ``min_s``, double each time up to ``max_s``."""

    min_s: float
    max_s: float

    def intervals(self):
        interval = self.min_s
        while True:
            yield interval
            interval = min(interval * 2, self.max_s)


def poll(
    probe: Callable[[], T | None],
    *,
    deadline: Deadline,
    backoff: Backoff,
    cancel: CancelToken | None = None,
    on_timeout: Callable[[], BaseException] | None = None,
    wake: threading.Event | None = None,
    pace: Callable[[], float] | None = None,
) -> T:
    """Call ``probe`` until it returns something other than None.

    Raises the cancel reason as soon as the token is cancelled, and ``on_timeout()`` (or
    :class:`DeadlineExceeded`) when the deadline passes first. Without a token the wait can
    only end by the probe's answer, an exception from the probe, or the deadline.
    ``wake``: an event that brings the next probe forward (a same-host wake-up; needs
    ``cancel``). ``pace()``: the shortest pause before the next probe, when a probe's cost
    grows with what it still waits for (the master reading the arrivals still missing).
    """
    for interval in backoff.intervals():
        if cancel is not None:
            cancel.check()
        result = probe()
        if result is not None:
            return result
        left = deadline.remaining()
        if left <= 0:
            raise on_timeout() if on_timeout else DeadlineExceeded(f"timed out waiting for {deadline.what}")
        if pace is not None:
            interval = max(interval, pace())
        pause = min(interval, left)
        if cancel is not None:
            cancel.sleep(pause, wake)
        else:
            deadline.clock.sleep(pause)
    raise AssertionError("unreachable")


class Sweep:
    """Which of many files a probe reads: all it still waits for (a sweep), at most
    ``reads_per_s`` of them a second, and between sweeps only those a same-host wake-up named
    (``wakeup.Wakeups.heard``). A waiter reading N files then costs N opens a sweep, not N a
    wake-up, and never more than ``reads_per_s`` a second in sweeps."""

    def __init__(self, reads_per_s: float, clock: Clock = REAL_CLOCK):
        self._rate = reads_per_s
        self._clock = clock
        self._next = float("-inf")
        self.full = False
        """Whether the last pick was a sweep (then the directory is worth refreshing first)."""

    def pick(self, waiting_for: list[T], heard: set[str], name: Callable[[T], str]) -> list[T]:
        now = self._clock.monotonic()
        self.full = now >= self._next
        if self.full:
            self._next = now + (len(waiting_for) + 1) / self._rate
            return list(waiting_for)
        return [k for k in waiting_for if name(k) in heard]


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int,
    backoff: Backoff,
    retry_on: Callable[[Exception], bool],
    before_retry: Callable[[Exception], None] | None = None,
    clock: Clock = REAL_CLOCK,
) -> T:
    """``fn()``, called again after a backoff pause when it raises an exception that
    ``retry_on`` accepts, at most ``attempts`` times in all; the last failure is raised.
    Only ``Exception`` is caught: an interrupt or a cancellation is never retried.
    ``before_retry(e)`` runs before each new try (to log, or to prepare it)."""
    pauses = backoff.intervals()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - filtered by retry_on
            if attempt == attempts or not retry_on(e):
                raise
            pause = next(pauses)
            if before_retry is not None:
                before_retry(e)
            else:
                log.warning("%s failed (%s); trying again in %.1f s (%d of %d)", what, e, pause, attempt, attempts)
            clock.sleep(pause)
    raise AssertionError("unreachable")
