"""One rank's side of the protocol: the executor of its decisions.

Joining an attempt is ``coordination/attendance.py``, the barriers ``coordination/barriers.py``
(this class's bases). Here: where the rank is, elastic membership, and how the rank ended.
Every rule is a pure function of what was read: membership's in ``protocol/membership.py``,
the monitor's verdicts in ``protocol/verdicts.py``. The coordinator reads the files, calls
the rule, and carries out the one action it returns: write a record, watch or forget a
rank, log, cancel the rank's work, raise.
"""

from __future__ import annotations

import logging
import time
import traceback

from orchestrator import defaults
from orchestrator.coordination.attendance import Entry
from orchestrator.coordination.barriers import Barriers
from orchestrator.coordination.monitor import publish_abort
from orchestrator.errors import ROOT_CAUSE_KINDS, ChildFailed, Culprit, FailureKind, MarkedOut, OrchestratorError, Retrain
from orchestrator.node import identity
from orchestrator.node.placement import Placement
from orchestrator.phase_table import Phase
from orchestrator.protocol import faults, fsio, membership, schema
from orchestrator.coordination import master_lease
from orchestrator.protocol.membership import ranks_text
from orchestrator.protocol.schema import Members
from orchestrator.protocol.verdicts import verdict_bound_s
from orchestrator.protocol.waiting import CancelToken, Deadline
from orchestrator.protocol.wire import Event, HeartbeatState

__all__ = ["Coordinator", "Entry"]

log = logging.getLogger(__name__)


class Coordinator(Barriers):
    def __init__(self, config, cancel: CancelToken, children):
        super().__init__(config, cancel, children)
        self.members = Members()
        """Master: who is out and who came back (attempts/<A>/members.json)."""
        self.train_round = 0
        """The try of this iteration's training (coordination.elastic: a step redone without a
        rank lost while it trained is round 1, 2, ...)."""
        self._training: int | None = None
        """rl.max_staleness >= 1: the iteration this node trains in the background, None when none."""
        self._members_writes = 0
        """Master: how many times it wrote members.json in this attempt (its heartbeat says it)."""

    # -- where the rank is, and what phases may tell it ----------------------------------------

    def set_position(self, iteration: int, phase: Phase, work_deadline: Deadline) -> None:
        """This rank starts ``phase``; its monitor cancels it if the work outlives ``work_deadline``."""
        with self._members_lock:
            self.where = (iteration, phase)
            if phase is Phase.TRAIN:
                self._enter_train_round(iteration)
        self.monitor.work_deadline = work_deadline
        self._phase_began = time.monotonic()
        self.events.emit(Event.PHASE, iteration=iteration, phase=int(phase))
        self.heartbeat.update(iteration=iteration, phase=phase.label, state=HeartbeatState.WORKING, progress=None)

    def position(self) -> tuple[int | None, Phase | None]:
        return self.where

    def in_run(self) -> tuple[Placement, frozenset[int]]:
        """The placement of the ranks in the run and the ranks out, as the latest barrier released."""
        return self.placement, self.out

    def verdict_s(self) -> float:
        """How long after a node dies every rank has heard it named, at the latest."""
        c = self.c
        bound = verdict_bound_s(c.node_timeout_s, c.heartbeat_interval_s, c.watch_s, self.fan_in is not None)
        return bound + (defaults.WORKER_GRACE_S if c.elastic else 0.0)

    def lost(self) -> frozenset[int]:
        """Master: the ranks its monitor marked out by now (elastic)."""
        return self.monitor.out

    def fault_point(self, action: str, iteration: int, phase: Phase) -> None:
        """Where a test's ORCHESTRATOR_FAULT may hold this rank or make it fail."""
        if self.fault is None or not self.fault.at(action, iteration, int(phase)):
            return
        self.fault = None  # once per process: an attempt started again after it does not hold there again
        if action == "raise":
            raise faults.InjectedFault(f"injected failure in phase {phase.label} of iteration {iteration}")
        log.warning("fault injection: holding at %s", (iteration, phase.label))
        self.heartbeat.update(state=HeartbeatState.HELD)
        self.cancel.sleep(faults.HOLD_LIMIT_S)

    def training_in_flight(self, iteration: int | None) -> None:
        """rl.max_staleness >= 1: the iteration this node trains while the rank walks on (None: none)."""
        self._training = iteration
        if self.heartbeat is not None:
            self.heartbeat.update(training=iteration, publish=False)

    def progress(self, done: int, total: int) -> None:
        self.heartbeat.update(progress={"done": done, "total": total}, publish=False)

    def timing(self, part: str, seconds: float, *, at: tuple[int, Phase] | None = None, **fields) -> None:
        """Record how long ``part`` of this phase's work took (``status --json``'s ``timing``);
        ``at``: of another phase than the rank's (a training in flight, rl.max_staleness)."""
        iteration, phase = at or self.where
        self.events.emit(Event.TIMING, iteration=iteration, phase=_number(phase), part=part, seconds=round(seconds, 4), **fields)

    def took(self, split: str, chunk: int, tasks: int, victim: int) -> None:
        """Record that this rank took chunk ``chunk`` of ``victim``'s first share (work stealing)."""
        iteration, phase = self.where
        self.events.emit(Event.STEAL, iteration=iteration, phase=_number(phase), split=split, chunk=chunk, tasks=tasks, victim=victim)

    # -- elastic membership: the rules of protocol/membership.py, carried out ------------------

    def _go_on_without(self, culprit: Culprit) -> bool:
        """Master's monitor, elastic: a worker went silent past the node timeout. True when
        the run goes on without it; a rank lost while the group trains gets the step trained
        again without it (a new round, which cancels every rank's try of it)."""
        rank = culprit.rank
        with self._members_lock:
            action = membership.on_silent(self.members, culprit, num_nodes=self.config.num_nodes, min_nodes=self.c.min_nodes,
                                          placement=self.full_placement, position=self.where,
                                          train_released=self._train_released, train_round=self.train_round,
                                          training_in_flight=self._in_flight())
            if isinstance(action, membership.EndAttempt):
                log.error("%s", action.reason)
                return False
            self.members.mark_out(rank, iteration=culprit.iteration, phase=culprit.phase, host=culprit.host, reason=culprit.error,
                                  nonce=self._nonces.get(rank))
            trained = action.iteration or self.where[0]
            if action.retrain is not None:
                self.members.declare_round(trained, action.retrain)
            self._write_members()
        self.monitor.forget(rank)
        self.events.emit(Event.OUT, iteration=culprit.iteration, phase=culprit.phase, who=rank, reason=culprit.error)
        survivors = membership.ranks_in(self.config.num_nodes, self.members.out)
        work = "they train this step again without it" if action.retrain else "its unfinished rollout work goes to them"
        log.warning("%s. coordination.elastic: the run goes on with ranks %s; %s. "
                    "Start the same command on that node to rejoin at the next iteration's start", culprit.describe(), survivors, work)
        # A training in the background is trained again only where it runs (the master may only roll out).
        here = action.iteration is None or bool(self.full_placement.train_workers_on(self.rank))
        if action.retrain and here and self.cancel.cancel(Retrain(
                f"rank {rank} was lost while iteration {trained} trained: ranks {survivors} train it again "
                f"(round {action.retrain}) from the same checkpoint")):
            self.monitor.on_cancel()
        return True

    def _write_members(self) -> None:
        """Master: publish the membership record, then say so in its heartbeat (workers read
        the record again only when that count changes)."""
        self.members.write(self.attempt.members)
        self._members_writes += 1
        self.heartbeat.update(members=self._members_writes)

    def _in_flight(self) -> int | None:
        """Master, rl.max_staleness >= 1: the iteration whose training runs on in the background
        (phase 10 released, phase 11 not yet)."""
        if not self.config.rl.max_staleness or self._train_released is None:
            return None
        return self._train_released if self._train_released != self._published else None

    def enter_train_round(self, iteration: int) -> None:
        """Train ``iteration`` again in the background as the round the master declared
        (rl.max_staleness >= 1; at phase 10 ``set_position`` does this)."""
        with self._members_lock:
            self._enter_train_round(iteration)

    def _enter_train_round(self, iteration: int) -> None:
        """Elastic, at each start of phase 10 (holding the members lock): the round of this
        iteration's training and the ranks it trains with."""
        if not self.c.elastic:
            return
        if not self.is_master:
            fsio.refresh_dir(self.attempt.root)
        members = self.members if self.is_master else Members.read(self.attempt.members)
        entered = membership.train_round(members, iteration, self.out, is_master=self.is_master)
        if entered.declare:
            members.declare_round(iteration, entered.round)
            self._write_members()
        self.train_round = entered.round
        self._apply_out(entered.out)
        if entered.round:
            log.warning("training iteration %d again (round %d) with ranks %s", iteration, entered.round,
                        membership.ranks_in(self.config.num_nodes, entered.out))

    def _members_news(self, members: Members) -> OrchestratorError | None:
        """Worker's monitor, elastic: what the master's membership record means for this process."""
        training = self._training  # a training in the background is this node's, wherever the rank walks
        position = (training, Phase.TRAIN) if training is not None else self.where
        news = membership.worker_news(members, self.rank, self.nonce, position, train_round=self.train_round, out=self.out)
        iteration, phase = self.where
        if isinstance(news, membership.Dropped):
            return MarkedOut(f"rank {self.rank} on host {identity.host()} was silent past coordination.node_timeout_s at iteration "
                             f"{iteration}, phase {_label(phase)}, and the run went on without it: stopping its work; it rejoins at "
                             f"the next iteration's start")
        if isinstance(news, membership.TrainAgain):
            return Retrain(f"rank(s) {ranks_text(news.lost)} were lost while iteration {position[0]} trained: training it again "
                           f"(round {news.round}) from the same checkpoint without them")
        return None

    def rearm(self, cancel: CancelToken) -> None:
        """Go on with ``cancel`` after a retrain ended the old token (its monitor with it)."""
        self.cancel = cancel
        if self.monitor is not None:
            self.monitor.rearm(cancel)

    def _admit_returning(self, iteration: int) -> None:
        """Master, at an iteration's start: take back the out ranks whose process asks to."""
        with self._members_lock:
            if not self.members.out:
                return
            fsio.refresh_dir(self.attempt.joins)
            found = membership.admissions(self.members, {r: fsio.read_record(self.attempt.join(r)) for r in sorted(self.members.out)},
                                          attempt=self.attempt_id, fingerprint=self.config.fingerprint())
            for rank, detail in found.refuse.items():
                log.warning("rank %d asks to rejoin with another configuration (%s): not admitted", rank, detail)
            for rank, join in found.admit.items():
                self.members.admit(rank, iteration=iteration, host=join["host"], nonce=join["nonce"])
                self._nonces[rank] = join["nonce"]
                self.hosts[rank] = join["host"]
            if found.admit:
                self._write_members()
        for rank in found.admit:
            self.monitor.watch([rank])
            self.events.emit(Event.REJOINED, iteration=iteration, phase=int(Phase.SYNC_START), who=rank)
            log.warning("rank %d on host %s rejoins the run at iteration %d", rank, self.hosts[rank], iteration)

    # -- ending -----------------------------------------------------------------------------

    def record_failure(self, kind: FailureKind, error: str, exc: BaseException | None = None, culprit: Culprit | None = None) -> None:
        """Write this rank's failure record (and, on the master, the attempt's abort)."""
        if self.attempt_id is None:
            return
        iteration, phase = self.where
        failure = schema.Failure(
            **identity.me(), rank=self.rank, iteration=iteration, phase=_label(phase), kind=kind, error=error,
            traceback="".join(traceback.format_exception(exc))[-4000:] if exc is not None else None,
            culprit=culprit, child=exc.child if isinstance(exc, ChildFailed) else None,
        )
        if self.events is not None:
            self.events.emit(Event.ERROR, iteration=iteration, phase=_label(phase), kind=kind, error=error[:2000],
                             culprit=culprit.rank if culprit is not None else None)
        try:
            schema.write(self.attempt.failure(self.rank), failure)
            if self.is_master and kind in ROOT_CAUSE_KINDS:
                publish_abort(self.attempt, failure.blames(), self.heartbeat)
        except OSError as e:
            log.error("could not write the failure record: %s", e)

    def start_afresh(self, cancel: CancelToken) -> None:
        """Master whose workers gave up on it: end its attempt (heartbeat failed, lease
        released) and forget its members, to join a new attempt that they can join too."""
        self.close(HeartbeatState.FAILED)
        self.lease = self.monitor = self.heartbeat = self.events = None
        self.attempt_id, self.cancel, self.hosts = None, cancel, {}
        self.members, self.out, self.train_round, self._train_released, self._published = Members(), frozenset(), 0, None, None
        self._training, self._members_writes = None, 0

    def close(self, state: HeartbeatState) -> None:
        if self.monitor is not None:
            self.monitor.halt()
        if self.heartbeat is not None:
            self.heartbeat.close(state)
        if self.events is not None:
            self.events.emit(Event.END, state=state)
            self.events.close()
        if self.lease is not None:
            master_lease.release(self.layout, self.lease)


def _label(phase: Phase | None) -> str | None:
    return phase.label if phase is not None else None


def _number(phase: Phase | None) -> int | None:
    return int(phase) if phase is not None else None
