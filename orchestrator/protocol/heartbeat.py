"""This rank's heartbeat: a counter rewritten every ``heartbeat_interval_s`` by a thread.

The file also says where the rank is (iteration, phase, state, progress, and how long it has
been in that phase and state), which is what ``orchestrator status`` shows. Heartbeats are not fsynced: a crash makes them stale anyway,
and close() already makes them visible to other NFS clients.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from orchestrator.node import identity
from orchestrator.protocol import fsio
from orchestrator.protocol.api import HeartbeatState

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, path: Path, *, rank: int, attempt: str, interval_s: float):
        self._path = path
        self._interval = interval_s
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
        self._phase_since = self._state_since = time.monotonic()

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def update(self, **fields) -> None:
        """Change what the heartbeat says and publish it now."""
        with self._lock:
            now = time.monotonic()
            if "phase" in fields or "iteration" in fields:
                self._phase_since = now
            if "state" in fields and fields["state"] != self._state.get("state"):
                self._state_since = now
            self._state.update(fields)
        self.beat()

    def beat(self) -> None:
        with self._lock:
            self._state["counter"] += 1
            now = time.monotonic()
            # Durations on this rank's own clock, so readers never compare two machines' clocks.
            body = {**self._state, "in_phase_s": round(now - self._phase_since, 3), "in_state_s": round(now - self._state_since, 3)}
            try:
                fsio.write_record(self._path, body, durable=False)
            except OSError as e:
                # A missed beat is survivable; the next one may get through (full disk, ESTALE).
                log.warning("heartbeat write failed: %s", e)

    def close(self, state: str) -> None:
        """Stop beating and leave a last word (``done``, ``failed``, ...)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 1)
        self.update(state=state)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.beat()

