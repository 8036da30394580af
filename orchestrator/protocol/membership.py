"""Which ranks the run goes on with (coordination.elastic), as rules over a snapshot.

``attempts/<A>/members.json`` (``schema.Members``) has one writer, the master. When a
worker's heartbeat stops for ``node_timeout_s`` (dead, or frozen), the master marks it out
instead of ending the attempt, as long as ``coordination.min_nodes`` ranks remain; barriers
stop waiting for it, and its unfinished rollout work goes to the others (data/claims.py). Each
rank process writes a fresh ``nonce`` in its join record: the out entry names the process
that went silent, so a process of that rank with another nonce (restarted, or the same one
after SIGCONT, which rejoins with a new one) is a request to come back. The master admits it
at the start of the next iteration (phase 0) and records that in ``admitted``.

A rank lost while the group trains (phase 10, before the master released it) leaves a step
the others cannot finish (with rl.max_staleness >= 1 the training runs on from phase 10 to 11 in
the background: a rank of its group lost then has it trained again there, by the ranks that
train, while the others walk on): the master declares a new training round of that iteration
(``train_round``: the iteration, the round, the ranks out), and every rank stops its
trainers and trains the step again, from the same checkpoint, without it.

Each rule is a pure function of what was read (and the rank's position) returning one
action; the coordinator reads the files, calls the rule and carries the action out
(tests/unit/test_membership.py drives every branch).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import Culprit
from orchestrator.node.placement import Placement
from orchestrator.phase_table import Phase
from orchestrator.protocol.join import config_mismatch
from orchestrator.protocol.schema import Members

__all__ = ["Members", "MarkOut", "EndAttempt", "TrainRound", "Dropped", "TrainAgain", "Admission",
           "on_silent", "train_round", "worker_news", "admissions", "ranks_in", "ranks_text"]


@dataclass(frozen=True, slots=True)
class MarkOut:
    """Go on without ``culprit.rank``; with ``retrain``, declare that round of the iteration's
    training (the rank was lost while the group trained)."""

    culprit: Culprit
    retrain: int | None = None
    iteration: int | None = None
    """The iteration trained again, when it is not the master's (a training in the
    background, rl.max_staleness >= 1)."""


@dataclass(frozen=True, slots=True)
class EndAttempt:
    """Too few ranks would be left: the attempt ends as it would without elastic."""

    reason: str


def on_silent(members: Members, culprit: Culprit, *, num_nodes: int, min_nodes: int, placement: Placement,
              position: tuple[int | None, Phase | None], train_released: int | None, train_round: int,
              training_in_flight: int | None = None) -> MarkOut | EndAttempt:
    """Master: a worker went silent past the node timeout (``culprit``, kind dead).
    ``training_in_flight`` (rl.max_staleness >= 1): the iteration the group trains in the
    background while the ranks walk a later rollout; a rank of that group lost then has that
    step trained again in the background without it, as the next round."""
    rank = culprit.rank
    out = set(members.out) | {rank}
    left = num_nodes - len(out)
    if left < min_nodes:
        return EndAttempt(f"rank {rank} went silent and only {left} rank(s) would be left, fewer than "
                          f"coordination.min_nodes={min_nodes}: the attempt ends")
    if not placement.without(out).train_workers:
        return EndAttempt(f"rank {rank} went silent and the ranks left hold no train worker: the attempt ends")
    if training_in_flight is not None and placement.train_workers_on(rank):
        return MarkOut(culprit, train_round + 1, iteration=training_in_flight)
    iteration, phase = position
    retrain = phase is Phase.TRAIN and train_released != iteration
    return MarkOut(culprit, train_round + 1 if retrain else None)


@dataclass(frozen=True, slots=True)
class TrainRound:
    """The round of an iteration's training a rank enters, the ranks it trains without, and
    whether the master declares that round now (a rank went out since the last release)."""

    round: int
    out: frozenset[int]
    declare: bool = False


def train_round(members: Members, iteration: int, out: frozenset[int], *, is_master: bool) -> TrainRound:
    """At each start of phase 10: ``out`` are the ranks the last release went on without."""
    declared = members.round_of(iteration)
    round_, out = declared if declared is not None else (0, out)
    if is_master and frozenset(members.out) != out:
        return TrainRound(round_ + 1, frozenset(members.out), declare=True)
    return TrainRound(round_, out)


@dataclass(frozen=True, slots=True)
class Dropped:
    """Worker: the run went on without this process; it stops its work and asks to rejoin."""


@dataclass(frozen=True, slots=True)
class TrainAgain:
    """Worker: ranks ``lost`` were lost while this iteration trained; train it as ``round``."""

    round: int
    lost: frozenset[int]


def worker_news(members: Members, rank: int, nonce: str | None, position: tuple[int | None, Phase | None], *,
                train_round: int, out: frozenset[int]) -> Dropped | TrainAgain | None:
    """Worker's monitor: what the master's membership record means for this process."""
    if members.is_out(rank, nonce):
        return Dropped()
    iteration, phase = position
    declared = members.round_of(iteration) if phase is Phase.TRAIN else None
    if declared is not None and declared[0] > train_round:
        return TrainAgain(declared[0], declared[1] - out)
    return None


@dataclass(frozen=True, slots=True)
class Admission:
    """Master, at an iteration's start: the out ranks to take back (rank -> their join
    record) and those refused (rank -> why)."""

    admit: dict[int, dict]
    refuse: dict[int, str]


def admissions(members: Members, joins: dict[int, dict | None], *, attempt: str, fingerprint: dict) -> Admission:
    """``joins``: the join record read for each out rank. A process asks to come back with
    a join record of this attempt and another nonce than the one that went silent; it is
    taken back if it runs the master's configuration."""
    admit, refuse = {}, {}
    for rank, join in sorted(joins.items()):
        if not members.wants_back(rank, join) or join.get("attempt") != attempt:
            continue
        mismatch = config_mismatch(fingerprint, {rank: join})
        if mismatch is not None:
            refuse[rank] = mismatch[1]
        else:
            admit[rank] = join
    return Admission(admit, refuse)


def ranks_text(ranks) -> str:
    """Ranks as log lines name them: ``1,2``."""
    return ",".join(str(r) for r in sorted(ranks))


def ranks_in(num_nodes: int, out) -> str:
    """The ranks in the run without ``out``, as log lines name them."""
    return ranks_text(r for r in range(num_nodes) if r not in out)
