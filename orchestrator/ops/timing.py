"""Where each iteration's time went, read from the ranks' event logs: `status` and `report`.

Two sources, both in ``attempts/<A>/events/r<R>.jsonl``:

- the master's ``phase`` and ``released`` events: seconds the master spent in each
  (iteration, phase), work and barrier together, on its own monotonic clock;
- every rank's ``timing`` events (``Coordinator.timing``): how long a part of a phase's
  work took (``train.steps``, ``engine.reload``, ...), per rank, train worker or engine.

Each log is folded into a :class:`LogDigest` as it is read, so a reader keeps per-phase
figures, not events; :class:`EventReader` reads only what was appended since its last
call, which keeps ``status --watch`` cheap on a long run.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.api import Event
from orchestrator.protocol.layout import RunLayout

MASTER = 0

# The parts in the order they are listed: training's in the order they happen, then the
# engines'; a part not listed here sorts after them, by name.
PART_ORDER = (
    "train.startup", "train.load", "train.prepare", "train.steps", "train.checkpoint", "train.total",
    "engine.start", "engine.restart", "engine.reload", "engine.release",
)

# EventLog writes compact JSON: a worker's lines that hold no timing are skipped unparsed.
_TIMING_MARK = b'"event":"' + Event.TIMING.value.encode() + b'"'


def attempt_ids(layout: RunLayout) -> list[str]:
    """The run's attempts that have event logs, oldest first (by lease generation)."""
    fsio.refresh_dir(layout.attempts)
    try:
        dirs = [p for p in layout.attempts.iterdir() if layout.attempt(p.name).events_dir.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []

    def key(p: Path):
        m = re.match(r"a(\d+)-", p.name)
        return (int(m.group(1)) if m else math.inf, p.name)

    return [p.name for p in sorted(dirs, key=key)]


def event_ranks(layout: RunLayout, attempt: str) -> list[int]:
    """The ranks with an event log in ``attempt``."""
    events_dir = layout.attempt(attempt).events_dir
    fsio.refresh_dir(events_dir)
    return sorted(int(p.stem[1:]) for p in events_dir.glob("r*.jsonl") if p.stem[1:].isdigit())


def part_sort_key(part: str) -> tuple[int, str]:
    return (PART_ORDER.index(part) if part in PART_ORDER else len(PART_ORDER), part)


@dataclass(slots=True)
class LogDigest:
    """What one rank's event log of one attempt says about time, fed one event at a time.

    ``durations``: (iteration, phase) -> seconds, from the rank's ``phase`` event to its next
    ``phase`` event or the phase's ``released`` event (read from the master's log only).
    ``parts``: (iteration, phase, part, worker, engine) -> seconds, the sum of the rank's
    ``timing`` events with that key (a part done twice in one phase took both times).
    """

    durations: dict[tuple[int, int], float] = field(default_factory=dict)
    parts: dict[tuple[int, int, str, object, object], float] = field(default_factory=dict)
    _current: tuple[tuple[int, int], float] | None = None

    def feed(self, e: dict) -> None:
        kind = e.get("event")
        if kind == Event.TIMING:
            seconds = e.get("seconds")
            if isinstance(e.get("iteration"), int) and isinstance(e.get("part"), str) and isinstance(seconds, (int, float)):
                key = (e["iteration"], e.get("phase"), e["part"], e.get("worker"), e.get("engine"))
                self.parts[key] = self.parts.get(key, 0.0) + float(seconds)
            return
        key = (e.get("iteration"), e.get("phase"))
        if kind == Event.PHASE:
            if self._current is not None:
                self.durations[self._current[0]] = e["mono"] - self._current[1]
            self._current = (key, e["mono"])
        elif kind == Event.RELEASED and self._current is not None and key == self._current[0]:
            self.durations[key] = e["mono"] - self._current[1]

    @classmethod
    def of(cls, events: list[dict]) -> "LogDigest":
        digest = cls()
        for e in events:
            digest.feed(e)
        return digest


@dataclass(slots=True)
class _Tail:
    inode: int
    offset: int
    digest: LogDigest


class EventReader:
    """Reads every attempt's event logs into digests; a later :meth:`read` reads only the
    bytes appended since (the logs are append-only), so one reader kept across the polls of
    ``status --watch`` reads each line once."""

    def __init__(self, layout: RunLayout):
        self.layout = layout
        self._tails: dict[Path, _Tail] = {}

    def read(self) -> list[tuple[str, int, LogDigest]]:
        """``(attempt, rank, digest)`` for every event log, oldest attempt first."""
        out = []
        for attempt in attempt_ids(self.layout):
            for rank in event_ranks(self.layout, attempt):
                digest = self._advance(self.layout.attempt(attempt).events(rank), rank == MASTER)
                if digest is not None:
                    out.append((attempt, rank, digest))
        return out

    def _advance(self, path: Path, master: bool) -> LogDigest | None:
        try:
            f = open(path, "rb")  # the open revalidates an NFS client's cached size (close-to-open)
        except FileNotFoundError:
            return None
        with f:
            inode = os.fstat(f.fileno()).st_ino
            tail = self._tails.get(path)
            if tail is None or tail.inode != inode:
                tail = self._tails[path] = _Tail(inode, 0, LogDigest())
            f.seek(tail.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a torn last line waits for the next read
        start = 0
        while start < end:
            stop = data.index(b"\n", start) + 1
            line = data[start:stop]
            if master or _TIMING_MARK in line:
                try:
                    tail.digest.feed(json.loads(line))
                except ValueError:
                    break  # a line not written out yet: read it again next time
            start = stop
        tail.offset += start
        return tail.digest


def phase_durations(digests: list[tuple[str, int, LogDigest]]) -> dict[tuple[int, int], float]:
    """Seconds the master spent in each (iteration, phase), work and barrier together, over
    every attempt (a later attempt wins)."""
    durations: dict[tuple[int, int], float] = {}
    for _, rank, digest in digests:
        if rank == MASTER:
            durations.update(digest.durations)
    return durations


def iteration_timing(digests: list[tuple[str, int, LogDigest]]) -> dict[int, dict]:
    """Per iteration: ``{"phases": {label: s}, "total_s": s, "parts": {part: s}}``.

    ``phases`` are the master's phase durations, ``total_s`` their sum. ``parts[p]`` is the
    slowest actor's time in part ``p`` (ranks, train workers and engines run in parallel):
    an actor (rank, worker, engine) adds up its times in the iteration's phases, and for
    the same phase a later attempt's figure replaces an earlier one's.
    """
    by_key: dict[tuple[int, int, str, object, object, int], float] = {}
    for _, rank, digest in digests:
        for (iteration, phase, part, worker, engine), seconds in digest.parts.items():
            by_key[(iteration, phase, part, worker, engine, rank)] = seconds
    per_actor: dict[tuple[int, str, object, object, int], float] = {}
    for (iteration, _, part, worker, engine, rank), seconds in by_key.items():
        actor = (iteration, part, worker, engine, rank)
        per_actor[actor] = per_actor.get(actor, 0.0) + seconds
    parts: dict[int, dict[str, float]] = {}
    for (iteration, part, *_), seconds in per_actor.items():
        slowest = parts.setdefault(iteration, {})
        slowest[part] = max(slowest.get(part, 0.0), seconds)
    phases: dict[int, dict[int, float]] = {}
    for (iteration, phase), seconds in phase_durations(digests).items():
        if isinstance(iteration, int) and isinstance(phase, int):
            phases.setdefault(iteration, {})[phase] = seconds
    out = {}
    for iteration in sorted(set(phases) | set(parts)):
        mine = phases.get(iteration, {})
        out[iteration] = {
            "phases": {_label(p): round(mine[p], 3) for p in sorted(mine)},
            "total_s": round(sum(mine.values()), 3),
            "parts": {p: round(s, 3) for p, s in sorted(parts.get(iteration, {}).items(), key=lambda kv: part_sort_key(kv[0]))},
        }
    return out


def _label(phase: int) -> str:
    try:
        return Phase(phase).label
    except ValueError:
        return str(phase)
