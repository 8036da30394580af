"""Time as a seam: the real monotonic clock, and a fake one tests move by hand."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that only moves when a test says so."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
