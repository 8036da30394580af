"""Judging peers alive or dead from their heartbeat counters.

A heartbeat is a counter a rank rewrites every ``heartbeat_interval_s``. A reader calls a
rank dead when the counter has not changed for ``node_timeout_s`` on the *reader's own*
monotonic clock: no file mtime, no comparison of two machines' clocks (docs/shared-filesystems.md,
"Liveness"). The tracker is pure bookkeeping over (observation, time) pairs so tests drive
it with a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.protocol.wire import TERMINAL_STATES


@dataclass(slots=True)
class _Seen:
    counter: object
    changed_at: float
    last: dict | None = None


@dataclass(slots=True)
class LivenessTracker:
    timeout_s: float
    _seen: dict[int, _Seen] = field(default_factory=dict)

    def watch(self, rank: int, now: float) -> None:
        """Start the clock on ``rank`` even before its first heartbeat is readable."""
        self._seen.setdefault(rank, _Seen(counter=None, changed_at=now))

    def forget(self, rank: int) -> None:
        """Stop judging ``rank`` (the run went on without it); ``watch`` starts afresh."""
        self._seen.pop(rank, None)

    def observe(self, rank: int, heartbeat: dict | None, now: float) -> None:
        """Record what was read for ``rank`` (None: absent or invalid, i.e. no news)."""
        seen = self._seen.setdefault(rank, _Seen(counter=None, changed_at=now))
        if heartbeat is None:
            return
        counter = (heartbeat.get("pid"), heartbeat.get("counter"))
        if counter != seen.counter:
            seen.counter = counter
            seen.changed_at = now
        seen.last = heartbeat

    def watched(self) -> list[int]:
        return sorted(self._seen)

    def silent_for(self, rank: int, now: float) -> float:
        return now - self._seen[rank].changed_at

    def last(self, rank: int) -> dict | None:
        seen = self._seen.get(rank)
        return seen.last if seen else None

    def dead(self, now: float) -> list[int]:
        """Ranks silent for longer than the timeout that have not ended on purpose."""
        out = []
        for rank, seen in sorted(self._seen.items()):
            if seen.last is not None and seen.last.get("state") in TERMINAL_STATES:
                continue
            if now - seen.changed_at > self.timeout_s:
                out.append(rank)
        return out

