"""This rank's heartbeat: a counter rewritten every ``heartbeat_interval_s`` by a thread.

The file also says where the rank is (iteration, phase, state, progress, and how long it has
been in that phase and state), which is what ``orchestrator status`` shows. Heartbeats are not fsynced: a crash makes them stale anyway,
and close() already makes them visible to other NFS clients.

Progress is ``{done, total, rate}``: tasks made durable in the phase's rollout, of how many,
and tasks per second since the phase first reported progress (its rollout began producing:
after the engine start, and not counting the tasks a restarted rank found in its shard).
The rate is null until the first durable batch, and every beat recomputes it on this rank's
clock, so a rank that stalls shows its rate falling; once done reaches total it stays at its
value then (the rank waits at the barrier, it is not slower).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from orchestrator.node import identity
from orchestrator.protocol import fsio
from orchestrator.protocol.wire import HeartbeatState

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, path: Path, *, rank: int, attempt: str, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self._path = path
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = {
            **identity.me(),
            "rank": rank,
            "attempt": attempt,
            "counter": 0,
            "iteration": None,
            "phase": None,
            "state": HeartbeatState.JOINING,
            "progress": None,
        }
        self._phase_since = self._state_since = clock()
        self._progress_since: tuple[float, int] | None = None
        """(when, done) of the phase's first progress report: where its rate counts from."""
        self._progress_at = 0.0
        """When progress was last reported."""
        self.last: dict | None = None
        """The body of the latest beat."""

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def update(self, publish: bool = True, **fields) -> None:
        """Change what the heartbeat says and publish it now; ``publish=False``: with the next
        beat (what only ``status`` shows: a phase, a state, progress; a rank's every step
        would otherwise cost a write on the shared filesystem)."""
        with self._lock:
            now = self._clock()
            if "phase" in fields or "iteration" in fields:
                self._phase_since = now
            if "state" in fields and fields["state"] != self._state.get("state"):
                self._state_since = now
            if "progress" in fields:
                progress = fields["progress"]
                if progress is None:
                    self._progress_since = None
                elif self._progress_since is None:
                    self._progress_since = (now, progress["done"])
                self._progress_at = now
            self._state.update(fields)
        if publish:
            self.beat()

    def beat(self) -> None:
        with self._lock:
            self._state["counter"] += 1
            now = self._clock()
            # Durations on this rank's own clock, so readers never compare two machines' clocks.
            body = {**self._state, "in_phase_s": round(now - self._phase_since, 3), "in_state_s": round(now - self._state_since, 3)}
            if body["progress"] is not None:
                body["progress"] = {**body["progress"], "rate": self._rate(now, **body["progress"])}
            self.last = body
            try:
                fsio.write_record(self._path, body, durable=False)
            except OSError as e:
                # A missed beat is survivable; the next one may get through (full disk, ESTALE).
                log.warning("heartbeat write failed: %s", e)

    def _rate(self, now: float, done: int, total: int) -> float | None:
        """Tasks per second since the phase's first progress report, until now or until the
        work was done; None before a batch."""
        since, base = self._progress_since
        until = self._progress_at if done >= total else now
        if done <= base or until <= since:
            return None
        return round((done - base) / (until - since), 3)

    def close(self, state: str) -> None:
        """Stop beating and leave a last word (``done``, ``failed``, ...)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 1)
        self.update(state=state)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.beat()

