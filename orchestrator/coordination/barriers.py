"""A rank's side of the barriers, carried out by the executor (coordination/executor.py) over
the rule of protocol/barrier.py.

Each rank rewrites its own ``arrive.json``; the master reads the names of the ranks still
missing until all match the barrier, runs the phase's decision, and rewrites
``release.json`` with it, then says so in its heartbeat (with the decision itself when it is
small); workers read that one file. O(N) metadata operations per round, all under
``attempts/A/``: a file of a crashed attempt never releases anything. With
coordination.fan_in, group leaders pass their members' arrivals on in one file each. With
coordination.elastic, phase 10's arrivals and release also carry the training round
(``round``, left out while it is 0): a step redone without a lost rank never counts an
arrival of the try before.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from orchestrator import defaults
from orchestrator.coordination import executor, wakeup
from orchestrator.coordination.attendance import Attendance
from orchestrator.coordination.monitor import publish_abort
from orchestrator.errors import Culprit, DeadlineExceeded, FailureKind
from orchestrator.node import identity
from orchestrator.phase_table import Phase
from orchestrator.protocol import barrier, fsio, schema
from orchestrator.protocol.actions import Wait
from orchestrator.protocol.membership import ranks_text
from orchestrator.protocol.schema import Arrival, GroupArrival, Point, Progress, Release, TrainingPlan
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, Sweep
from orchestrator.protocol.wire import Event, HeartbeatState


@dataclass(frozen=True, slots=True)
class _Released:
    """Worker: the master released the point the rank waits at, with this decision."""

    decision: dict


_LEAD = object()
"""Worker: it leads its group now and has not passed its members' arrivals on."""
_NOT_LEADING = object()
"""Group leader: a lower rank leads the group again."""


class Barriers(Attendance):
    """The barriers of ``Coordinator`` (its base), on ``Attendance`` (joining an attempt)."""

    def __init__(self, config, cancel: CancelToken, children):
        super().__init__(config, cancel, children)
        self._phase_began = time.monotonic()
        self.out: frozenset[int] = frozenset()
        """Ranks the run goes on without, as the latest barrier released (coordination.elastic)."""
        self._train_released: int | None = None
        """Master: the last iteration whose training it released (no retrain after that)."""
        self._published: int | None = None
        """Master: the last iteration whose checkpoint it published (phase 11 released)."""
        self.fan_in = barrier.FanIn.of(config.num_nodes, self.c.fan_in)
        """The worker groups whose leaders pass arrivals on to the master (None: no fan-in)."""
        self._waits: deque[float] = deque(maxlen=16)
        """Worker: how long its latest barriers took to release, arrival to release seen."""

    def _admit_returning(self, iteration: int) -> None:
        """Master, elastic, at an iteration's start: take back the out ranks that ask to (Coordinator's)."""
        raise NotImplementedError

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
        """Worker: read the master's heartbeat (shared with the monitor) until it says it
        released ``point``, then take the decision from it, or from ``release.json``; a group's
        leader first passes its members' arrivals on (``_pass_on``), and so does a rank that
        becomes its group's leader while it waits. Reads back off to watch_interval_s, the first
        after half the median of this rank's latest waits (a round that takes a second at a
        thousand ranks is not read every few ms); a master on this host wakes the wait at once."""
        word = self.monitor.word
        passed_on = False

        def decide():
            if not passed_on and self._led_group() is not None:
                return _LEAD
            beat = word.read()
            if beat is None or not barrier.said_released(beat.get("released"), point):
                return Wait()
            if beat.get("decision") is not None:  # small: the heartbeat carries it
                return _Released(beat["decision"])
            decision = barrier.released(schema.read(self.attempt.release, Release), point)
            if decision is None:  # an NFS client that cached the directory: look again
                fsio.refresh_dir(self.attempt.root)
                decision = barrier.released(schema.read(self.attempt.release, Release), point)
            return Wait() if decision is None else _Released(decision)

        until = deadline.extended(defaults.WORKER_GRACE_S)
        release = executor.Operation(decide, lambda _: self._deadline(point, f"the master did not release {point.phase.label} in time", 0))
        while True:
            first = min(max(self.c.poll_min_s, statistics.median(self._waits or [0.0]) / 2), self.c.watch_s)
            with self._wakeups(self.attempt.heartbeats, [word.path.name], ranks=[0]) as wakes:
                result = executor.run(release, until, cancel=self.cancel, backoff=Backoff(first, self.idle_backoff.max_s), wake=wakes.event)
            if result is not _LEAD:
                return result.decision
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

        def decide():
            out = self._out_seen()
            if fan_in.leader(group, out) != self.rank:
                return _NOT_LEADING
            read = sweep.pick(rule.missing(out), wakes.heard(), lambda r: self.attempt.arrive(r).name)
            if sweep.full:
                fsio.refresh_dir(self.attempt.arrivals)
            return rule.decide({r: schema.read(self.attempt.arrive(r), Arrival) for r in read}, out)

        def act(action) -> bool:
            if action is _NOT_LEADING:
                return False
            schema.write(self.attempt.group_arrival(group), GroupArrival(self.attempt_id, point.iteration, point.phase,
                                                                         self.rank, action.payloads, point.round), durable=False)
            return True

        def timed_out(action) -> BaseException:
            if action is None:
                return DeadlineExceeded(f"timed out waiting for {until.what}")
            return self._deadline(point, f"rank {self.rank}, leader of ranks {ranks_text(rule.ranks)}, still waits for ranks "
                                         f"{ranks_text(action.missing)}", min(action.missing))

        with self._wakeups(self.attempt.arrivals, None, ranks=rule.ranks) as wakes:
            return executor.run(executor.Operation(decide, timed_out, act), until, cancel=self.cancel, backoff=self.idle_backoff,
                                wake=wakes.event)

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

        def read_arrivals():
            if self.c.elastic and point.phase is Phase.SYNC_START:
                self._admit_returning(point.iteration)
            out = self.monitor.out
            return rule.decide(gather(rule.missing(out), wakes.heard()), out)

        def timed_out(action) -> DeadlineExceeded:
            return late(action.missing if action is not None else rule.missing(self.monitor.out))

        with self._wakeups(self.attempt.arrivals, None, ranks=range(self.config.num_nodes)) as wakes:
            action = executor.run(executor.Operation(read_arrivals, timed_out), deadline, cancel=self.cancel, backoff=self.backoff,
                                  wake=wakes.event)
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

    def _apply_out(self, out) -> None:
        """The ranks in the run from this barrier on: the placement without the others."""
        out = frozenset(out)
        if out != self.out:
            self.out = out
            self.placement = self.full_placement.without(out) if out else self.full_placement


def _counts(payload: dict | None) -> dict:
    """The numbers of a barrier payload (counts, sizes), for the event log."""
    return {k: v for k, v in (payload or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
