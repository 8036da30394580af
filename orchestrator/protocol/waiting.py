"""Deadlines, cancellation and polling with backoff: every wait in the project goes here."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from orchestrator.errors import DeadlineExceeded, OrchestratorError

T = TypeVar("T")


class CancelToken:
    """Set once, by whoever first learns the rank must stop; every wait checks it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: OrchestratorError | None = None
        self._lock = threading.Lock()

    def cancel(self, reason: OrchestratorError) -> bool:
        """Record ``reason`` unless a reason is already set; True if this call set it."""
        with self._lock:
            if self._reason is not None:
                return False
            self._reason = reason
            self._event.set()
            return True

    @property
    def reason(self) -> OrchestratorError | None:
        return self._reason

    def check(self) -> None:
        if self._reason is not None:
            raise self._reason

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake and raise at once if the token is cancelled."""
        if self._event.wait(max(0.0, seconds)):
            raise self._reason  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class Deadline:
    """A point on this process's monotonic clock, with what to say when it passes."""

    at: float
    what: str

    @classmethod
    def after(cls, seconds: float, what: str) -> "Deadline":
        return cls(time.monotonic() + seconds, what)

    def remaining(self) -> float:
        return self.at - time.monotonic()

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
    cancel: CancelToken,
    backoff: Backoff,
    on_timeout: Callable[[], OrchestratorError] | None = None,
) -> T:
    """Call ``probe`` until it returns something other than None.

    Raises the cancel reason as soon as the token is cancelled, and ``on_timeout()`` (or
    :class:`DeadlineExceeded`) when the deadline passes first.
    """
    for interval in backoff.intervals():
        cancel.check()
        result = probe()
        if result is not None:
            return result
        left = deadline.remaining()
        if left <= 0:
            raise on_timeout() if on_timeout else DeadlineExceeded(f"timed out waiting for {deadline.what}")
        cancel.sleep(min(interval, left))
    raise AssertionError("unreachable")
