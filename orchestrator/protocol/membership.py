"""Which ranks the run goes on with (coordination.elastic): the master's one record per attempt.

``attempts/<A>/members.json`` has one writer, the master. When a worker's heartbeat stops
for ``node_timeout_s`` (dead, or frozen), the master marks it out instead of ending the
attempt, as long as ``coordination.min_nodes`` ranks remain; barriers stop waiting for it,
and its unfinished rollout work goes to the others (data/work.py). Each rank process writes
a fresh ``nonce`` in its join record: the out entry names the process that went silent, so a
process of that rank with another nonce (restarted, or the same one after SIGCONT, which
rejoins with a new one) is a request to come back. The master admits it at the start of the
next iteration (phase 0) and records that in ``admitted``.

A rank lost while the group trains (phase 10, before the master released it) leaves a step
the others cannot finish: the master declares a new training round of that iteration
(``train_round``: the iteration, the round, the ranks out), and every rank stops its
trainers and trains the step again, from the same checkpoint, without it.

The pure part is here; the coordinator does the reading, writing and watching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.protocol import fsio


@dataclass(slots=True)
class Members:
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
        record = fsio.read_record(path) or {}
        return cls({int(r): v for r, v in record.get("out", {}).items()},
                   {int(r): v for r, v in record.get("admitted", {}).items()}, list(record.get("events", [])),
                   record.get("train_round"))

    def write(self, path: Path) -> None:
        fsio.write_record(path, {"out": {str(r): v for r, v in sorted(self.out.items())},
                                 "admitted": {str(r): v for r, v in sorted(self.admitted.items())}, "events": self.events,
                                 "train_round": self.train_round})

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


def survivors(num_nodes: int, out) -> list[int]:
    return [r for r in range(num_nodes) if r not in out]
