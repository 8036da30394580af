"""One rank's side of the protocol: the executor of its decisions.

Joining an attempt is in ``protocol/attendance.py`` (this class's base). Here: where the rank
is, barriers, elastic membership, and how the rank ended. Every rule is a pure function of
what was read: the barrier's in ``protocol/barrier.py``, membership's in
``protocol/membership.py``, the monitor's verdicts in ``protocol/monitor.py``. The
coordinator reads the files, calls the rule, and carries out the one action it returns:
write a record, watch or forget a rank, log, cancel the rank's work, raise.

Barriers. Each rank rewrites its own ``arrive.json``; the master reads the names of the
ranks still missing until all match the barrier, runs the phase's decision, and rewrites
``release.json`` with it; workers poll that one file. O(N) metadata operations per round,
all under ``attempts/A/``: a file of a crashed attempt never releases anything. With
coordination.elastic, phase 10's arrivals and release also carry the training round
(``round``, left out while it is 0): a step redone without a lost rank never counts an
arrival of the try before.
"""

from __future__ import annotations

import logging
import statistics
import time
import traceback
from collections import deque
from typing import Callable

from orchestrator import defaults
from orchestrator.errors import (
    ROOT_CAUSE_KINDS,
    ChildFailed,
    Culprit,
    DeadlineExceeded,
    FailureKind,
    MarkedOut,
    OrchestratorError,
    Retrain,
)
from orchestrator.node import identity
from orchestrator.node.placement import Placement
from orchestrator.phase_table import Phase
from orchestrator.protocol import barrier, faults, fsio, membership, schema, wakeup
from orchestrator.protocol import lease as lease_mod
from orchestrator.protocol.wire import Event, HeartbeatState
from orchestrator.protocol.attendance import Attendance, Entry
from orchestrator.protocol.monitor import publish_abort, verdict_bound_s
from orchestrator.protocol.membership import ranks_text
from orchestrator.protocol.schema import Arrival, GroupArrival, Members, Point, Progress, Release, TrainingPlan
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, Sweep, poll

__all__ = ["Coordinator", "Entry"]

log = logging.getLogger(__name__)


class Coordinator(Attendance):
    def __init__(self, config, cancel: CancelToken, children):
        super().__init__(config, cancel, children)
        self._phase_began = time.monotonic()
        self.out: frozenset[int] = frozenset()
        """Ranks the run goes on without, as the latest barrier released (coordination.elastic)."""
        self.members = Members()
        """Master: who is out and who came back (attempts/<A>/members.json)."""
        self.train_round = 0
        """The try of this iteration's training (coordination.elastic: a step redone without a
        rank lost while it trained is round 1, 2, ...)."""
        self._train_released: int | None = None
        """Master: the last iteration whose training it released (no retrain after that)."""
        self._published: int | None = None
        """Master: the last iteration whose checkpoint it published (phase 11 released)."""
        self._training: int | None = None
        """rl.max_staleness >= 1: the iteration this node trains in the background, None when none."""
        self._members_writes = 0
        """Master: how many times it wrote members.json in this attempt (its heartbeat says it)."""
        self.fan_in = barrier.FanIn.of(config.num_nodes, self.c.fan_in)
        """The worker groups whose leaders pass arrivals on to the master (None: no fan-in)."""
        self._waits: deque[float] = deque(maxlen=16)
        """Worker: how long its latest barriers took to release, arrival to release seen."""

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

    # -- barriers ---------------------------------------------------------------------------

    def barrier(self, iteration: int, phase: Phase, payload: dict | None, deadline: Deadline,
                decide: Callable[[dict[int, dict]], dict],
                in_force: Callable[[dict], tuple[TrainingPlan, ...]] = lambda _decision: ()) -> dict:
        """Arrive, wait for everyone, and return the master's decision for this phase.
        ``in_force(decision)``: the training plans released and not yet published once this
        decision is, which the master keeps in ``progress.json`` for a resume."""
        self.cancel.check()  # a rank cancelled during its work must not arrive
        self.monitor.work_deadline = None  # from here on the barrier's own deadline applies
        point = Point(iteration, phase, self.train_round if phase is Phase.TRAIN else 0)
        payload = payload or {}
        # Not fsynced, like release.json and the group files: a crash ends the attempt they belong to,
        # and nothing resumes from them (control/progress.json is the durable resume point).
        schema.write(self.attempt.arrive(self.rank), Arrival(self.attempt_id, iteration, phase, payload, point.round), durable=False)
        arrived = time.monotonic()
        self.events.emit(Event.ARRIVE, iteration=iteration, phase=int(phase), work_s=round(arrived - self._phase_began, 4),
                         payload=_counts(payload))
        self.heartbeat.update(state=HeartbeatState.WAITING, publish=False)
        self.fault_point("hold-after-arrive", iteration, phase)
        if self.is_master:
            decision = self._release(point, deadline, decide, in_force)
        else:
            decision = self._await_release(point, deadline, payload)
            self._waits.append(time.monotonic() - arrived)
            if "out" in decision:
                self._apply_out(decision["out"])
        self.events.emit(Event.RELEASED, iteration=iteration, phase=int(phase), wait_s=round(time.monotonic() - arrived, 4))
        return decision

    def _await_release(self, point: Point, deadline: Deadline, payload: dict) -> dict:
        """Worker: poll the master's heartbeat (shared with the monitor) until it says it
        released ``point``, then read the decision from ``release.json``; a group's leader
        first passes its members' arrivals on (``_pass_on``), and so does a rank that becomes
        its group's leader while it waits. Polls back off to watch_interval_s, the first after
        half the median of this rank's latest waits (a round that takes a second at a
        thousand ranks is not polled every few ms); a master on this host wakes the wait at once."""
        word = self.monitor.word
        passed_on = False
        lead = object()

        def probe():
            if not passed_on and self._led_group() is not None:
                return lead
            beat = word.read()
            if beat is None or not barrier.said_released(beat.get("released"), point):
                return None
            if beat.get("decision") is not None:  # small: the heartbeat carries it
                return beat["decision"]
            decision = barrier.released(schema.read(self.attempt.release, Release), point)
            if decision is None:  # an NFS client that cached the directory: look again
                fsio.refresh_dir(self.attempt.root)
                decision = barrier.released(schema.read(self.attempt.release, Release), point)
            return decision

        until = deadline.extended(defaults.WORKER_GRACE_S)
        while True:
            first = min(max(self.c.poll_min_s, statistics.median(self._waits or [0.0]) / 2), self.c.watch_s)
            with self._wakeups(self.attempt.heartbeats, [word.path.name], ranks=[0]) as wakes:
                result = poll(probe, deadline=until, cancel=self.cancel, backoff=Backoff(first, self.idle_backoff.max_s),
                              wake=wakes.event,
                              on_timeout=lambda: self._deadline(point, f"the master did not release {point.phase.label} in time", 0))
            if result is not lead:
                return result
            passed_on = self._pass_on(point, until, payload)

    def _out_seen(self) -> frozenset[int]:
        """Worker: the ranks out of the run as it last heard (the master's membership record,
        which its monitor reads when the master says it changed; else the last release's)."""
        members = self.monitor.members_seen() if self.monitor is not None else None
        return frozenset(members.out) if members is not None else self.out

    def _led_group(self) -> int | None:
        """Worker: the group it leads now (coordination.fan_in), if any."""
        if self.fan_in is None or self.is_master:
            return None
        group = self.fan_in.group(self.rank)
        return group if self.fan_in.leader(group, self._out_seen()) == self.rank else None

    def _pass_on(self, point: Point, until: Deadline, payload: dict) -> bool:
        """Group leader: read its members' arrivals until every one in the run has arrived at
        ``point``, then write them in one file for the master (``arrivals/g<G>.json``). False
        when it stopped leading first (a lower rank came back into the run)."""
        fan_in = self.fan_in
        group = fan_in.group(self.rank)
        rule = barrier.MasterBarrier(self.attempt_id, point, self.config.num_nodes, until, arrived={self.rank: payload},
                                     ranks=fan_in.ranks(group))
        sweep = Sweep(defaults.MASTER_READS_PER_S)

        def probe(wakes):
            out = self._out_seen()
            if fan_in.leader(group, out) != self.rank:
                return False
            missing = rule.missing(out)
            read = sweep.pick(missing, wakes.heard(), lambda r: self.attempt.arrive(r).name)
            if sweep.full:
                fsio.refresh_dir(self.attempt.arrivals)
            action = rule.decide({r: schema.read(self.attempt.arrive(r), Arrival) for r in read}, out)
            if isinstance(action, barrier.TimedOut):
                raise self._deadline(point, f"rank {self.rank}, leader of ranks {ranks_text(rule.ranks)}, still waits for ranks "
                                            f"{ranks_text(action.missing)}", min(action.missing))
            if isinstance(action, barrier.ReleaseAll):
                schema.write(self.attempt.group_arrival(group), GroupArrival(self.attempt_id, point.iteration, point.phase,
                                                                             self.rank, action.payloads, point.round), durable=False)
                return True
            return None

        with self._wakeups(self.attempt.arrivals, None, ranks=rule.ranks) as wakes:
            return poll(lambda: probe(wakes), deadline=until, cancel=self.cancel, backoff=self.idle_backoff, wake=wakes.event)

    def _wakeups(self, directory, names, *, ranks) -> wakeup.Wakeups:
        """A wait's same-host wake-ups: on ``names`` of ``directory`` when one of ``ranks``
        (their writers) runs on this host; none otherwise (the wait polls)."""
        wakes = wakeup.Wakeups()
        here = identity.host()
        if any(self.hosts.get(r) == here for r in ranks if r != self.rank):
            wakes.watch(directory, names)
        return wakes

    def _release(self, point: Point, deadline: Deadline, decide: Callable[[dict[int, dict]], dict],
                 in_force: Callable[[dict], tuple[TrainingPlan, ...]]) -> dict:
        rule = barrier.MasterBarrier(self.attempt_id, point, self.config.num_nodes, deadline)
        sweep = Sweep(defaults.MASTER_READS_PER_S)
        fan_in = self.fan_in

        def late(missing) -> DeadlineExceeded:
            arrived = frozenset(r for r in missing if (a := schema.read(self.attempt.arrive(r), Arrival)) and a.at(self.attempt_id, point))
            culprit, why = barrier.blame_late(missing, arrived, fan_in, self.monitor.out)
            return self._deadline(point, f"barrier {point.phase.label} {why} after deadlines.{point.phase.name.lower()}", culprit)

        def gather(missing: tuple[int, ...], heard: set[str]) -> dict[int, Arrival | None]:
            """The arrivals to decide on: every missing rank's file, or with fan-in the files of
            the groups with missing ranks (and the own files of ranks a group file leaves out)."""
            if fan_in is None:
                read = sweep.pick(missing, heard, lambda r: self.attempt.arrive(r).name)
                if sweep.full:
                    fsio.refresh_dir(self.attempt.arrivals)
                return {r: schema.read(self.attempt.arrive(r), Arrival) for r in read}
            groups = sweep.pick(fan_in.groups_of(missing), heard, lambda g: self.attempt.group_arrival(g).name)
            if sweep.full:
                fsio.refresh_dir(self.attempt.arrivals)
            records = {g: schema.read(self.attempt.group_arrival(g), GroupArrival) for g in groups}
            found, own = fan_in.unpack(self.attempt_id, point, tuple(r for r in missing if r == 0 or fan_in.group(r) in records), records)
            return {**found, **{r: schema.read(self.attempt.arrive(r), Arrival) for r in own}}

        def probe(wakes):
            if self.c.elastic and point.phase is Phase.SYNC_START:
                self._admit_returning(point.iteration)
            out = self.monitor.out
            action = rule.decide(gather(rule.missing(out), wakes.heard()), out)
            if isinstance(action, barrier.TimedOut):
                raise late(action.missing)
            return action if isinstance(action, barrier.ReleaseAll) else None

        with self._wakeups(self.attempt.arrivals, None, ranks=range(self.config.num_nodes)) as wakes:
            action = poll(lambda: probe(wakes), deadline=deadline, cancel=self.cancel, backoff=self.backoff, wake=wakes.event,
                          on_timeout=lambda: late(rule.missing(self.monitor.out)))
        self.events.emit(Event.ALL_ARRIVED, iteration=point.iteration, phase=int(point.phase))
        if self.c.elastic and point.phase is Phase.TRAIN:
            with self._members_lock:  # a rank lost from here on does not undo the finished step
                self.cancel.check()
                self._train_released = point.iteration
        if self.c.elastic and point.phase is Phase.PUBLISH:
            with self._members_lock:  # its decision published the checkpoint: the training is done
                self._published = point.iteration
        out = sorted(self.monitor.out)
        if self.c.elastic:
            self._apply_out(out)  # the decision (the plan, the training group) is made for these ranks
        self.monitor.work_deadline = deadline  # the decision is the master's work: bound it too
        decision = decide(action.payloads)
        if self.c.elastic:
            decision = {**decision, "out": out}
        self.monitor.work_deadline = None
        if self.monitor.stop_requested is not None:
            decision = {**decision, "stop": self.monitor.stop_requested}
        schema.write(self.attempt.release, Release(point.iteration, point.phase, decision, point.round), durable=False)
        schema.write(self.layout.progress, Progress(point.iteration, point.phase, self.attempt_id,
                                                    self.config.rl.max_staleness, in_force(decision)))
        self.heartbeat.update(released=barrier.said(point), decision=barrier.small(decision))  # what the waiting workers poll
        return decision

    def _deadline(self, point: Point, message: str, culprit_rank: int) -> DeadlineExceeded:
        culprit = Culprit(culprit_rank, self.hosts.get(culprit_rank, "?"), point.iteration, point.phase.label, FailureKind.DEADLINE,
                          message)
        if self.is_master:
            publish_abort(self.attempt, culprit, self.heartbeat)
        return DeadlineExceeded(culprit.describe())

    # -- elastic membership: the rules of protocol/membership.py, carried out ------------------

    def _apply_out(self, out) -> None:
        """The ranks in the run from this barrier on: the placement without the others."""
        out = frozenset(out)
        if out != self.out:
            self.out = out
            self.placement = self.full_placement.without(out) if out else self.full_placement

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
            lease_mod.release(self.layout, self.lease)


def _counts(payload: dict | None) -> dict:
    """The numbers of a barrier payload (counts, sizes), for the event log."""
    return {k: v for k, v in (payload or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _label(phase: Phase | None) -> str | None:
    return phase.label if phase is not None else None


def _number(phase: Phase | None) -> int | None:
    return int(phase) if phase is not None else None
