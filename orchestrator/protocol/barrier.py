"""A barrier, as a rule over a snapshot of the arrival files.

Each rank rewrites its own ``arrive.json`` with (iteration, phase, round, payload); the
master reads the names of the ranks still missing until every rank in the run has arrived
at this point, runs the phase's decision, and rewrites ``release.json`` with it; workers
poll that one file. An arrival counts only for its own attempt and point: a file of a
crashed attempt, of an earlier phase, or of a training round tried before never releases
anything. A rank the run goes on without (coordination.elastic) is no longer waited for, and
what it wrote no longer counts; a rank admitted back is waited for again.

The coordinator reads, calls :meth:`MasterBarrier.decide`, and carries out the action it
returns (tests/unit/test_barrier.py drives it with plain records and a fake clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.protocol.schema import Arrival, Point, Release
from orchestrator.protocol.waiting import Deadline


@dataclass(frozen=True, slots=True)
class Wait:
    missing: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReleaseAll:
    """Every rank in the run arrived: decide the phase with their payloads and release."""

    payloads: dict[int, dict]


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The barrier's deadline passed with ``missing`` not arrived; the first one is named."""

    missing: tuple[int, ...]


@dataclass(slots=True)
class MasterBarrier:
    """The master's view of one barrier: who has arrived at ``point`` of ``attempt`` so far."""

    attempt: str
    point: Point
    num_nodes: int
    deadline: Deadline
    arrived: dict[int, dict] = field(default_factory=dict)

    def missing(self, out: frozenset[int]) -> tuple[int, ...]:
        """The ranks in the run (all but ``out``) that have not arrived yet: the files to read."""
        return tuple(r for r in range(self.num_nodes) if r not in out and r not in self.arrived)

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
