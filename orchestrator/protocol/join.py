"""Joining an attempt, as decisions over a snapshot of the run's files.

Each poll, the coordinator (the executor) reads a snapshot of the files that matter, asks
the decision here for one action, and performs it: write this rank's join record, watch a
rank, log, fail, or go on. The shape is ``torch.distributed.elastic``'s dynamic rendezvous
(state, then an action per step). A decision does no I/O; its only notion of time is the
:class:`Deadline` it is given, so unit tests drive every branch with plain records and a
fake clock (tests/unit/test_join_and_lease.py).

Master: the ranks 1..N-1 must each write ``joins/r<R>.json`` naming this attempt before
``coordination.join_timeout_s``; all of them must run the master's configuration.

Worker: follow ``control/lease.json`` to the live master's attempt, join it, and wait for
its ``start.json`` to list this process; never rejoin an attempt it left (its master died),
and never join one that ended or started without it, except with ``coordination.elastic``:
then it joins the running attempt and asks the master to admit it at the next iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.protocol import records
from orchestrator.errors import Culprit
from orchestrator.protocol.actions import TimedOut, Wait
from orchestrator.protocol.lease import Lease
from orchestrator.protocol.waiting import Deadline


# -- master ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Ranks seen joining in this snapshot (the executor watches them); ``complete`` when
    no rank is missing any more."""

    joins: dict[int, dict]
    complete: bool


@dataclass(slots=True)
class MasterJoin:
    """The master's view of who has joined ``attempt`` so far."""

    attempt: str
    num_nodes: int
    deadline: Deadline
    joins: dict[int, dict] = field(default_factory=dict)

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r in range(1, self.num_nodes) if r not in self.joins)

    def decide(self, records: dict[int, dict | None]) -> Admit | Wait | TimedOut:
        """``records``: the join record read for each missing rank (None: not there yet)."""
        new = {r: rec for r, rec in sorted(records.items())
               if r in self.missing and rec is not None and rec.get("attempt") == self.attempt}
        self.joins.update(new)
        if new or not self.missing:
            return Admit(new, complete=not self.missing)
        if self.deadline.expired():
            return TimedOut(self.missing)
        return Wait()


def config_mismatch(mine: dict, joins: dict[int, dict]) -> tuple[int, str] | None:
    """The first rank whose configuration fingerprint differs from the master's, and how."""
    for r, j in sorted(joins.items()):
        theirs = j["fingerprint"]
        diff = [k for k in mine if mine.get(k) != theirs.get(k)]
        if diff:
            return r, "; ".join(f"{k}: master {mine.get(k)!r} vs rank {r} {theirs.get(k)!r}" for k in diff)
    return None


def changed_keys(before: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(key, value before, value now) of every setting two fingerprints differ in, nested
    sections as ``section.key``."""
    out = []
    for k in sorted(set(before) | set(now)):
        old, new = before.get(k), now.get(k)
        if isinstance(old, dict) and isinstance(new, dict):
            out += changed_keys(old, new, f"{prefix}{k}.")
        elif old != new:
            out.append((f"{prefix}{k}", old, new))
    return out


# -- worker ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What a worker read in one poll. ``joined_*`` are the files of the attempt this rank
    joined (None if it joined none); ``lease_*`` those of the attempt the lease names."""

    lease: Lease | None
    lease_start: dict | None = None
    lease_abort: dict | None = None
    joined_start: dict | None = None
    joined_abort: dict | None = None
    finished: bool = False
    """``control/progress.json`` says the run has no phase left under this configuration."""


@dataclass(frozen=True, slots=True)
class Finished:
    """No master holds the run and it has nothing left to walk: this rank ends (exit 0)."""


@dataclass(frozen=True, slots=True)
class Enter:
    """Join the lease's attempt: write this rank's join record (after checking that no live
    process holds the rank), then poll again."""

    lease: Lease
    rejoin: bool = False
    """The attempt runs already (elastic): the rank asks to come back, silent until admitted."""


@dataclass(frozen=True, slots=True)
class Rejoin:
    """The attempt this rank joined runs without it (elastic): wait for the master to admit
    it at an iteration's start (protocol/membership.py)."""

    start: dict


@dataclass(frozen=True, slots=True)
class Started:
    """The attempt started with this process: ``start`` is its start record."""

    start: dict


@dataclass(frozen=True, slots=True)
class Abandoned:
    """The master gave up on the attempt this rank joined (its abort record names why)."""

    culprit: Culprit


@dataclass(slots=True)
class WorkerJoin:
    """A worker's joining state: the attempt it is in, and the attempts it left."""

    rank: int
    pid: int
    run: str
    """The run's directory, for messages."""
    elastic: bool = False
    nonce: str | None = None
    """This process's nonce in its latest join record."""
    joined: str | None = None
    left: set[str] = field(default_factory=set)

    def _mine(self, start: dict | None) -> bool:
        if start is None or start["joined"].get(str(self.rank)) != self.pid:
            return False
        return start.get("nonces", {}).get(str(self.rank), self.nonce) == self.nonce

    def decide(self, view: WorkerView, deadline: Deadline) -> Wait | Enter | Rejoin | Started | Abandoned | TimedOut | Finished:
        if self.joined is not None:
            # The attempt this rank joined, first: its master may start it and even finish it
            # (releasing the lease) between two polls.
            if view.joined_abort is not None:
                return Abandoned(records.from_dict(view.joined_abort["culprit"], Culprit))
            if self._mine(view.joined_start):
                return Started(view.joined_start)
            if self.elastic and view.joined_start is not None:
                return Rejoin(view.joined_start)
        action = self._follow_lease(view)
        if isinstance(action, Wait) and deadline.expired():
            return TimedOut()
        return action

    def _follow_lease(self, view: WorkerView) -> Wait | Enter | Started | Finished:
        lease = view.lease
        if (lease is None or lease.released) and view.finished:
            return Finished()
        if lease is None or lease.released:
            return Wait(message=f"waiting for the master (rank 0) to start an attempt under {self.run}")
        if lease.attempt in self.left:
            return Wait(message=f"the master of attempt {lease.attempt} died; waiting for a new master (restart rank 0)")
        if view.lease_abort is not None:
            return Wait(message=f"attempt {lease.attempt} has ended; waiting for a new master")
        if lease.attempt != self.joined:
            if view.lease_start is not None and self.elastic:
                return Enter(lease, rejoin=True)
            if view.lease_start is not None:  # it started without this process: a stale lease of a dead master
                return Wait(message=f"attempt {lease.attempt} already started without this rank; waiting for a new master")
            return Enter(lease)
        if view.lease_start is None:
            return Wait()
        if not self._mine(view.lease_start):
            return Wait(message=f"attempt {lease.attempt} started with another process as rank {self.rank}; waiting for a new master")
        return Started(view.lease_start)

    def leave(self, *, for_good: bool = True) -> None:
        """This rank leaves its attempt: for good when its master died (never join that
        attempt again), else to ask to come back (elastic: the run went on without it)."""
        if self.joined is not None and for_good:
            self.left.add(self.joined)
        self.joined = None
