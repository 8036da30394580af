"""This rank's event log: one JSON object per line, appended, in the rank's own file.

Events carry both clocks: ``t`` (wall, for humans and for comparing ranks on one host) and
``mono`` (this process's monotonic clock, for durations). Not fsynced: a lost tail costs a
few timing records, never correctness.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, path: Path, rank: int):
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._f = None

    def emit(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "rank": self.rank, "t": time.time(), "mono": time.monotonic(), **fields},
                          separators=(",", ":"))
        with self._lock:
            try:
                if self._f is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._f = open(self.path, "a", encoding="utf-8")
                self._f.write(line + "\n")
                self._f.flush()
            except OSError as e:
                log.warning("could not append to the event log %s: %s", self.path, e)

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def read_events(path: Path) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    break  # a torn last line
    except FileNotFoundError:
        pass
    return out
