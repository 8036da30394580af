"""The records of the protocol, each a type: what a rank writes under ``attempts/<A>/`` and
``control/``, and reads back, goes through here (``write``, ``read``).

A record is a frozen dataclass; ``orchestrator.records`` turns it into the JSON body that
``fsio`` publishes (checksum envelope, temp + fsync + rename) and back, checking every
field's type. The file formats are those docs/protocol.md lists: a field that is empty by
default (a training round of 0) is left out, as it always was. Phases are ``Phase`` values
here and in memory; the files hold their numbers, and labels (``10:train``) where a person
reads them (failure records, heartbeats, ``status``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from orchestrator.protocol import records
from orchestrator.errors import Culprit
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio

R = TypeVar("R")

_OMIT_WHEN_EMPTY = ("round",)


def write(path: Path, record: Any, *, durable: bool = True) -> None:
    body = records.to_dict(record)
    for key in _OMIT_WHEN_EMPTY:
        if body.get(key) == 0:
            del body[key]
    fsio.write_record(path, body, durable=durable)


def read(path: Path, kind: type[R]) -> R | None:
    """The ``kind`` record at ``path``; None when it is absent or torn (``fsio.read_record``)
    or does not fit the type (a record of another version: no news, like a torn one)."""
    body = fsio.read_record(path)
    if body is None:
        return None
    try:
        return records.from_dict(body, kind, str_keys=True)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Point:
    """One barrier of the run: phase ``phase`` of ``iteration``, in training round ``round``
    (phase 10 tried again without a lost rank; 0 otherwise)."""

    iteration: int
    phase: Phase
    round: int = 0


@dataclass(frozen=True, slots=True)
class Arrival:
    """``arrive.json``: a rank finished its work of a phase (``payload``: what it reports)."""

    attempt: str
    iteration: int
    phase: Phase
    payload: dict = field(default_factory=dict)
    round: int = 0

    def at(self, attempt: str, point: Point) -> bool:
        return self.attempt == attempt and Point(self.iteration, self.phase, self.round) == point


@dataclass(frozen=True, slots=True)
class GroupArrival:
    """``arrivals/g<G>.json``: a group's leader passes on its members' arrivals, each with
    its payload (coordination.fan_in; protocol/barrier.py)."""

    attempt: str
    iteration: int
    phase: Phase
    leader: int
    payloads: dict[int, dict] = field(default_factory=dict)
    round: int = 0

    def at(self, attempt: str, point: Point) -> bool:
        return self.attempt == attempt and Point(self.iteration, self.phase, self.round) == point

    def arrival(self, rank: int) -> Arrival:
        return Arrival(self.attempt, self.iteration, self.phase, self.payloads[rank], self.round)


@dataclass(frozen=True, slots=True)
class Release:
    """``release.json``: the master let every rank past a barrier, with the phase's decision."""

    iteration: int
    phase: Phase
    decision: dict
    round: int = 0

    def at(self, point: Point) -> bool:
        return Point(self.iteration, self.phase, self.round) == point


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    """Phase 9's decision: what one iteration's update trains on, from which policy, into
    which checkpoint. Released to every rank, and kept in ``progress.json`` until the
    checkpoint is published, so that a resume between phases 9 and 11 has it too."""

    iteration: int
    data: str
    """The sealed train aggregate, relative to the log path."""
    records: int
    """Its records (one per task)."""
    init: str | None
    """The policy checkpoint the update starts from, relative to the log path; None: the base model."""
    init_iteration: int
    """The iteration that checkpoint's update made (0: the base model)."""
    output: str
    """The checkpoint the update makes, relative to the log path."""


@dataclass(frozen=True, slots=True)
class Progress:
    """``control/progress.json``: the last barrier the run released (where a resume starts)."""

    iteration: int
    phase: Phase
    attempt: str
    max_staleness: int = 0
    """The rl.max_staleness the run walks with: it decides the order of its points
    (protocol/schedule.py), so a resume with another value is refused."""
    training: tuple[TrainingPlan, ...] = ()
    """The training plans released and not yet published (one in lockstep, up to
    rl.max_staleness + 1 pipelined)."""


@dataclass(frozen=True, slots=True)
class Start:
    """``start.json``: the master started the attempt with these processes, at this point."""

    attempt: str
    iteration: int
    phase: Phase
    plan: dict | None
    hosts: dict[int, str]
    joined: dict[int, int]
    """Rank -> the pid of its process in the attempt."""
    nonces: dict[int, str | None]
    """Rank -> the nonce of that process's join record (a process that rejoins writes a new one)."""
    fingerprint: dict
    num_nodes: int
    rl_phase: str
    coordination: dict
    gpus: dict[int, dict]
    placement: dict
    training: tuple[TrainingPlan, ...] = ()
    """The training plans in force where the attempt starts (``Progress.training``)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """``failures/r<R>.json``: how a rank ended, in its own words."""

    host: str
    pid: int
    pid_start: float | None
    rank: int
    iteration: int | None
    phase: str | None
    kind: str
    error: str
    traceback: str | None = None
    culprit: Culprit | None = None
    child: dict | None = None
    at: float = field(default_factory=time.time)

    def blames(self) -> Culprit:
        """This rank as the culprit its own record names."""
        return Culprit(self.rank, self.host, self.iteration, self.phase, self.kind, self.error, self.child)


@dataclass(slots=True)
class Members:
    """``members.json`` (coordination.elastic): which ranks the run goes on without, and who
    came back. One writer, the master; the rules over it are in ``protocol/membership.py``."""

    out: dict[int, dict] = field(default_factory=dict)
    """Rank -> when and why it went out (iteration, phase, host, reason, the nonce of the silent process)."""
    admitted: dict[int, dict] = field(default_factory=dict)
    """Rank -> the iteration it came back at and the nonce of the process admitted."""
    events: list[dict] = field(default_factory=list)
    """Every out and rejoined, in order (``status`` and ``report`` show them)."""
    train_round: dict | None = None
    """The latest training round the master declared: ``{"iteration", "round", "out"}`` (round
    0, the first try of each iteration, is never written)."""

    @classmethod
    def read(cls, path: Path) -> "Members":
        return read(path, cls) or cls()

    def write(self, path: Path) -> None:
        write(path, Members(dict(sorted(self.out.items())), dict(sorted(self.admitted.items())), self.events, self.train_round))

    def mark_out(self, rank: int, *, iteration: int | None, phase: str | None, host: str, reason: str, nonce: str | None) -> None:
        entry = {"iteration": iteration, "phase": phase, "host": host, "reason": reason, "nonce": nonce, "at": time.time()}
        self.out[rank] = entry
        self.admitted.pop(rank, None)
        self.events.append({"event": "out", "rank": rank, **entry})

    def admit(self, rank: int, *, iteration: int, host: str, nonce: str) -> None:
        del self.out[rank]
        self.admitted[rank] = {"iteration": iteration, "host": host, "nonce": nonce, "at": time.time()}
        self.events.append({"event": "rejoined", "rank": rank, "iteration": iteration, "host": host, "at": time.time()})

    def round_of(self, iteration: int) -> tuple[int, frozenset[int]] | None:
        """(round, ranks out) of ``iteration``'s training if the master declared one."""
        t = self.train_round
        if t is None or t["iteration"] != iteration:
            return None
        return t["round"], frozenset(t["out"])

    def declare_round(self, iteration: int, round_: int) -> None:
        """Train ``iteration`` again, as round ``round_``, without the ranks out now."""
        self.train_round = {"iteration": iteration, "round": round_, "out": sorted(self.out), "at": time.time()}

    def is_out(self, rank: int, nonce: str | None) -> bool:
        """Whether the process of ``rank`` with ``nonce`` is the one the run went on without."""
        entry = self.out.get(rank)
        return entry is not None and entry.get("nonce") == nonce

    def wants_back(self, rank: int, join: dict | None) -> bool:
        """Whether ``join`` (rank's join record) is a process asking to come back."""
        return rank in self.out and join is not None and join.get("nonce") != self.out[rank].get("nonce")
