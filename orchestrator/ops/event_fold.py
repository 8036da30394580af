"""The one reader of the ranks' event logs (``attempts/<A>/events/r<R>.jsonl``), folding each
log as it is read: what `status` (each iteration's time, the ETA) and `report` (the same
time, the timeline, barrier waits, steals, ranks marked out and rejoined) know of the events.

A :class:`RankLog` keeps what the events add up to, not the events, and :class:`EventReader`
reads only the bytes appended since its last call, which keeps ``status --watch`` cheap on a
long run. Status needs only the master's phases and every rank's ``timing`` events, so by
default a worker's other lines are skipped unparsed and no spans are kept; the report asks
for every line and the spans (``timeline=True``).

What one log folds into:

- ``durations``: (iteration, phase) -> seconds from the rank's ``phase`` event to its next
  ``phase`` event or the phase's ``released`` event, on its monotonic clock (status and
  report read the master's);
- ``parts``: (iteration, phase, part, worker, engine) -> seconds, the sum of the rank's
  ``timing`` events with that key (a part done twice in one phase took both times);
  ``part_bytes`` the same for the bytes those events say they wrote or read (``bytes``);
- segments, one per stretch of time, of three kinds:

  - ``work``: from the rank's ``phase`` event (it enters the phase) to its ``arrive`` event
    (it arrives at the barrier) or, for a phase without a barrier (``rollout``,
    ``prepare``), to its next ``phase`` event;
  - ``wait``: the rank sits at the barrier. Workers: ``arrive`` to ``released``. Master:
    ``arrive`` to ``all_arrived`` (the last rank's arrival);
  - ``decide``: master only, ``all_arrived`` to ``released`` (the phase's decision, then
    the release and progress records).

  A segment's seconds come from the monotonic clock (``mono``) when both ends have it and
  it did not go backwards, else from the wall clock ``t``;
- ``steals`` (work stealing) and ``membership`` (``out``, ``rejoined``: coordination.elastic,
  as the master recorded them), at wall times;
- the first and last wall time, which place the log on the run's timeline.
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
from orchestrator.protocol.wire import Event
from orchestrator.protocol.layout import RunLayout

MASTER = 0

# EventLog writes compact JSON: a worker's lines that hold no timing are skipped unparsed.
_TIMING_MARK = b'"event":"' + Event.TIMING.value.encode() + b'"'


def is_number(x) -> bool:
    """A finite number and not a bool: what a figure read from a run's JSON must be to count."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def phase_label(phase) -> str:
    """``"10:train"`` for a phase number; a value that names no phase, as it is."""
    try:
        return Phase(phase).label
    except (ValueError, TypeError):
        return str(phase)


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


def _seconds(a: dict, b: dict) -> float:
    ma, mb = a.get("mono"), b.get("mono")
    if is_number(ma) and is_number(mb) and mb >= ma:
        return mb - ma
    return max(0.0, b["t"] - a["t"])


# Which open segment an event closes completely, by the event that closes it.
_CLOSES = {Event.PHASE: ("work",), Event.ARRIVE: ("work",), Event.ALL_ARRIVED: ("wait",), Event.RELEASED: ("wait", "decide")}
# Which segment an event opens.
_OPENS = {Event.PHASE: "work", Event.ARRIVE: "wait", Event.ALL_ARRIVED: "decide"}


BYTE_KINDS = ("state", "delta")
"""What a timing event's ``bytes`` may be broken down into, as ``bytes_<kind>``."""


@dataclass(slots=True)
class RankLog:
    """One rank's event log of one attempt, fed one event at a time (see the module docstring).
    ``spans``: also keep its segments, steals, membership changes and wall times, which only
    the report draws (status, polling a long run, keeps only figures)."""

    attempt: str
    rank: int
    spans: bool = True
    events: int = 0
    durations: dict[tuple[int, int], float] = field(default_factory=dict)
    parts: dict[tuple[int, int, str, object, object], float] = field(default_factory=dict)
    part_bytes: dict[tuple[int, int, str, object, object], int] = field(default_factory=dict)
    part_byte_kinds: dict[tuple[int, int, str, object, object], dict[str, int]] = field(default_factory=dict)
    """Of ``part_bytes``, what they were by kind: ``state`` (``bytes_state``: optimizer, fp32
    master) and ``delta`` (``bytes_delta``: weights written as deltas)."""
    steals: list[dict] = field(default_factory=list)
    membership: list[dict] = field(default_factory=list)
    first_t: float | None = None
    last_t: float | None = None
    _current: tuple[tuple[int, int], float] | None = None
    _closed: list[dict] = field(default_factory=list)
    _open: tuple[dict, dict] | None = None
    _last: dict | None = None

    @classmethod
    def of(cls, events: list[dict], attempt: str = "", rank: int = MASTER) -> "RankLog":
        log = cls(attempt, rank)
        for e in events:
            log.feed(e)
        return log

    def feed(self, e: dict) -> None:
        if not isinstance(e, dict):
            return
        self.events += 1
        kind = e.get("event") if isinstance(e.get("event"), str) else None
        if kind == Event.TIMING:
            seconds = e.get("seconds")
            if isinstance(e.get("iteration"), int) and isinstance(e.get("part"), str) and isinstance(seconds, (int, float)):
                key = (e["iteration"], e.get("phase"), e["part"], e.get("worker"), e.get("engine"))
                self.parts[key] = self.parts.get(key, 0.0) + float(seconds)
                if isinstance(e.get("bytes"), int):
                    self.part_bytes[key] = self.part_bytes.get(key, 0) + e["bytes"]
                for kind in BYTE_KINDS:
                    if isinstance(e.get(f"bytes_{kind}"), int):
                        kinds = self.part_byte_kinds.setdefault(key, {})
                        kinds[kind] = kinds.get(kind, 0) + e[f"bytes_{kind}"]
        else:
            self._feed_duration(kind, e)
        if self.spans and is_number(e.get("t")):
            self._feed_span(kind, e)

    def _feed_duration(self, kind, e: dict) -> None:
        mono = e.get("mono")
        if not is_number(mono):
            return
        key = (e.get("iteration"), e.get("phase"))
        if kind == Event.PHASE:
            if self._current is not None:
                self.durations[self._current[0]] = mono - self._current[1]
            self._current = (key, mono)
        elif kind == Event.RELEASED and self._current is not None and key == self._current[0]:
            self.durations[key] = mono - self._current[1]

    def _feed_span(self, kind, e: dict) -> None:
        t = e["t"]
        self.first_t = t if self.first_t is None else min(self.first_t, t)
        self.last_t = t if self.last_t is None else max(self.last_t, t)
        self._last = e
        if kind == Event.STEAL:
            self.steals.append({"victim": e.get("victim"), "split": e.get("split"), "chunk": e.get("chunk"),
                                "tasks": e.get("tasks"), "iteration": e.get("iteration"), "t": t})
        elif kind in (Event.OUT, Event.REJOINED):
            self.membership.append({"event": kind, "rank": e.get("who"), "iteration": e.get("iteration"), "t": t})
        if kind in _CLOSES or kind == Event.END:
            self._close(e, kind)
        if kind in _OPENS:
            self._open = ({"kind": _OPENS[kind], "iteration": e.get("iteration"), "phase": e.get("phase"), "t_start": t}, e)

    def _close(self, e: dict, kind) -> None:
        """Ends the open segment at ``e``: complete when ``e`` is the event that ends its kind
        in the same phase (the previous phase's work also ends at a ``phase`` event: it had no
        barrier, or the log lost its arrival)."""
        if self._open is None:
            return
        seg, start = self._open
        same = kind == Event.PHASE or (seg["iteration"], seg["phase"]) == (e.get("iteration"), e.get("phase"))
        complete = same and seg["kind"] in _CLOSES.get(kind, ())
        self._closed.append({**seg, "t_end": e["t"], "seconds": _seconds(start, e), "complete": complete})
        self._open = None

    def segments(self) -> list[dict]:
        """The segments so far, ``{kind, iteration, phase, t_start, t_end, seconds, complete}``
        at absolute wall times. ``complete`` is False for a segment the log leaves open (the
        rank ended, failed or is still in it): it ends at the rank's ``end`` event, or at its
        last event."""
        if self._open is None:
            return list(self._closed)
        seg, start = self._open
        return [*self._closed, {**seg, "t_end": self._last["t"], "seconds": _seconds(start, self._last), "complete": False}]


def rank_segments(events: list[dict]) -> list[dict]:
    """One rank's event log of one attempt, as segments (:meth:`RankLog.segments`)."""
    return RankLog.of(events).segments()


@dataclass(slots=True)
class _Tail:
    inode: int
    offset: int
    log: RankLog


class EventReader:
    """Reads every attempt's event logs into :class:`RankLog` folds; a later :meth:`read`
    reads only the bytes appended since (the logs are append-only), so one reader kept across
    the polls of ``status --watch`` reads each line once. ``timeline``: fold every line of
    every rank, spans included (the report), not only the times in the master's lines and the
    workers' ``timing`` lines (status)."""

    def __init__(self, layout: RunLayout, timeline: bool = False, master_only: bool = False):
        self.layout = layout
        self.timeline = timeline
        self.master_only = master_only
        """Read the master's logs only (its phase times, and its own timing events)."""
        self._tails: dict[Path, _Tail] = {}

    def read(self) -> list[RankLog]:
        """A fold of every event log, oldest attempt first, then by rank."""
        out = []
        for attempt in attempt_ids(self.layout):
            for rank in [MASTER] if self.master_only else event_ranks(self.layout, attempt):
                log = self._advance(self.layout.attempt(attempt).events(rank), attempt, rank)
                if log is not None:
                    out.append(log)
        return out

    def _advance(self, path: Path, attempt: str, rank: int) -> RankLog | None:
        try:
            f = open(path, "rb")  # the open revalidates an NFS client's cached size (close-to-open)
        except FileNotFoundError:
            return None
        with f:
            inode = os.fstat(f.fileno()).st_ino
            tail = self._tails.get(path)
            if tail is None or tail.inode != inode:
                tail = self._tails[path] = _Tail(inode, 0, RankLog(attempt, rank, spans=self.timeline))
            f.seek(tail.offset)
            data = f.read()
        every_line = self.timeline or rank == MASTER
        end = data.rfind(b"\n") + 1  # a torn last line waits for the next read
        start = 0
        while start < end:
            stop = data.index(b"\n", start) + 1
            line = data[start:stop]
            if every_line or _TIMING_MARK in line:
                try:
                    tail.log.feed(json.loads(line))
                except ValueError:
                    break  # a line not written out yet: read it again next time
            start = stop
        tail.offset += start
        return tail.log
