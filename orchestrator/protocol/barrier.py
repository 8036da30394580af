"""A barrier, as a rule over a snapshot of the arrival files.

Each rank rewrites its own ``arrive.json`` with (iteration, phase, round, payload); the
master reads the names of the ranks still missing until every rank in the run has arrived
at this point, runs the phase's decision, and rewrites ``release.json`` with it; workers
poll that one file. An arrival counts only for its own attempt and point: a file of a
crashed attempt, of an earlier phase, or of a training round tried before never releases
anything. A rank the run goes on without (coordination.elastic) is no longer waited for, and
what it wrote no longer counts; a rank admitted back is waited for again.

Fan-in (coordination.fan_in, :class:`FanIn`). Above a size the workers form groups of
consecutive ranks; the lowest rank of a group still in the run is its leader, which reads its
members' arrivals (the same rule, :class:`MasterBarrier` over the group's ranks) and passes
them on in one file, ``arrivals/g<G>.json``. The master reads the group files (O(sqrt N) a
round) instead of every rank's; a rank a group file leaves out (the leader saw it out of the
run, the master no longer does) has its own file read. A dead leader is a dead rank like any
other: without coordination.elastic the attempt ends naming it; with it, the run goes on
without it and the next rank of its group leads. Releases come back through the master's
heartbeat and ``release.json``, one file every worker reads, as without fan-in.

The coordinator reads, calls :meth:`MasterBarrier.decide`, and carries out the action it
returns (tests/unit/test_barrier.py drives it with plain records and a fake clock).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from orchestrator import defaults
from orchestrator.protocol.actions import TimedOut, Wait
from orchestrator.protocol.membership import ranks_text
from orchestrator.protocol.schema import Arrival, GroupArrival, Point, Release
from orchestrator.protocol.waiting import Deadline


@dataclass(frozen=True, slots=True)
class ReleaseAll:
    """Every rank in the run arrived: decide the phase with their payloads and release."""

    payloads: dict[int, dict]


@dataclass(slots=True)
class MasterBarrier:
    """The master's view of one barrier: who has arrived at ``point`` of ``attempt`` so far
    (a group leader's, with ``ranks`` its group's)."""

    attempt: str
    point: Point
    num_nodes: int
    deadline: Deadline
    arrived: dict[int, dict] = field(default_factory=dict)
    ranks: tuple[int, ...] | None = None
    """The ranks this barrier waits for: all of the run's when None."""

    def missing(self, out: frozenset[int]) -> tuple[int, ...]:
        """The ranks in the run (all but ``out``) that have not arrived yet: the files to read."""
        ranks = range(self.num_nodes) if self.ranks is None else self.ranks
        return tuple(r for r in ranks if r not in out and r not in self.arrived)

    def decide(self, read: dict[int, Arrival | None], out: frozenset[int]) -> ReleaseAll | Wait | TimedOut:
        """``read``: the arrival read for each missing rank (None: absent or torn);
        ``out``: the ranks the run goes on without, now."""
        for r in [r for r in self.arrived if r in out]:  # the run went on without it
            del self.arrived[r]
        for r, arrival in read.items():
            if r not in out and arrival is not None and arrival.at(self.attempt, self.point):
                self.arrived[r] = arrival.payload
        missing = self.missing(out)
        if not missing:
            return ReleaseAll(dict(sorted(self.arrived.items())))
        if self.deadline.expired():
            return TimedOut(missing)
        return Wait(missing)


def released(record: Release | None, point: Point) -> dict | None:
    """Worker: the master's decision for ``point``, once ``release.json`` carries it."""
    return record.decision if record is not None and record.at(point) else None


def said(point: Point) -> list[int]:
    """``point`` as the master's heartbeat carries it once released: [iteration, phase, round]."""
    return [point.iteration, int(point.phase), point.round]


def said_released(value: object, point: Point) -> bool:
    """Worker: whether the master's heartbeat says it released ``point`` (then ``release.json``
    holds its decision: the master writes that file first)."""
    return value == said(point)


SMALL_DECISION_BYTES = 256
"""A decision this small (as JSON) rides in the master's heartbeat with its ``released``: the
workers then need not open ``release.json`` (most phases decide ``{}``)."""


def small(decision: dict) -> dict | None:
    """Master: ``decision`` if it is small enough for its heartbeat, else None (read the file)."""
    return decision if len(json.dumps(decision, separators=(",", ":"))) <= SMALL_DECISION_BYTES else None


@dataclass(frozen=True, slots=True)
class FanIn:
    """The workers 1 .. num_nodes-1 in groups of ``size`` consecutive ranks: group 0 is ranks
    1 .. size, group 1 the next ``size``, and so on (the master belongs to none)."""

    num_nodes: int
    size: int

    @classmethod
    def of(cls, num_nodes: int, fan_in: int) -> FanIn | None:
        """coordination.fan_in for a run of ``num_nodes``: None when arrivals go straight to
        the master (fan_in 1, or automatic below ``defaults.FAN_IN_FROM`` ranks); automatic
        (0): groups of ceil(sqrt(workers)), so leaders and master each read about sqrt(N) files."""
        size = fan_in or (math.isqrt(num_nodes - 2) + 1 if num_nodes >= defaults.FAN_IN_FROM else 1)
        return cls(num_nodes, size) if size >= 2 and num_nodes >= 2 else None

    @property
    def count(self) -> int:
        return -(-(self.num_nodes - 1) // self.size)

    def group(self, rank: int) -> int:
        return (rank - 1) // self.size

    def ranks(self, group: int) -> tuple[int, ...]:
        return tuple(range(1 + group * self.size, min(1 + (group + 1) * self.size, self.num_nodes)))

    def leader(self, group: int, out: frozenset[int]) -> int | None:
        """The lowest rank of ``group`` in the run (None: the run goes on without all of them)."""
        return next((r for r in self.ranks(group) if r not in out), None)

    def groups_of(self, ranks) -> list[int]:
        return sorted({self.group(r) for r in ranks if r != 0})

    def unpack(self, attempt: str, point: Point, missing: tuple[int, ...], records: dict[int, GroupArrival | None]
               ) -> tuple[dict[int, Arrival | None], tuple[int, ...]]:
        """Master: the arrivals that the group files ``records`` (by group) carry for the
        ``missing`` ranks, and the ranks whose own file to read: those a group file of this
        point leaves out (its leader saw them out of the run, or they came back after it wrote).
        A group without a file of this point is waited for: its leader still collects."""
        found: dict[int, Arrival | None] = {}
        own: list[int] = []
        for r in missing:
            if r == 0:
                own.append(r)
                continue
            record = records.get(self.group(r))
            if record is None or not record.at(attempt, point):
                found[r] = None
            elif r in record.payloads:
                found[r] = record.arrival(r)
            else:
                own.append(r)
        return found, tuple(own)


def blame_late(missing: tuple[int, ...], arrived: frozenset[int], fan_in: FanIn | None, out: frozenset[int]
               ) -> tuple[int, str]:
    """Master, at a barrier's deadline: the rank to name and why. ``missing``: the ranks the
    master has no arrival of; ``arrived``: those of them whose own file says they arrived (a
    leader that did not pass them on is to blame then)."""
    late = tuple(r for r in missing if r not in arrived)
    if late or fan_in is None:
        return min(late or missing), f"still waits for ranks {ranks_text(late or missing)}"
    group = fan_in.group(min(missing))
    leader = fan_in.leader(group, out)
    return (leader if leader is not None else min(missing)), (
        f"has no word from rank {leader}, the leader of ranks {ranks_text(fan_in.ranks(group))} (coordination.fan_in), "
        f"though ranks {ranks_text(missing)} arrived")
