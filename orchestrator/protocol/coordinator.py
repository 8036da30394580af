"""One rank's side of the protocol: join an attempt, pass barriers, record how it ended.

Joining. The master takes the lease (``protocol/lease.py``), which names a fresh attempt ``A``;
every rank writes ``attempts/A/joins/r<R>.json``; the master reads those N known names,
checks that all ranks run the same configuration, and publishes ``attempts/A/start.json``
with the resume point. A worker finds ``A`` by polling ``control/lease.json``, and follows
the lease if a new master starts a new attempt while it waits. What to do at each poll is
decided in ``protocol/join.py`` (and ``lease.Takeover``); this module reads and writes.

Barriers. Each rank rewrites its own ``arrive.json`` with (iteration, phase, payload); the
master polls the N known names until all match, runs the phase's decision, and rewrites
``release.json`` with it; workers poll that one file. O(N) metadata operations per round.
Everything is under ``attempts/A/``: a file of a crashed attempt never releases anything.
With coordination.elastic, phase 10's arrivals and release also carry the training round
(``round``, left out while it is 0): a step redone without a lost rank never counts an
arrival of the try before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Callable

from orchestrator import defaults, records
from orchestrator.config import RunConfig
from orchestrator.errors import (
    ROOT_CAUSE_KINDS,
    BadInput,
    ChildFailed,
    ConfigError,
    Culprit,
    DeadlineExceeded,
    FailureKind,
    MarkedOut,
    OrchestratorError,
    PeerFailed,
    Retrain,
    StopRequested,
)
from orchestrator.node import checks, facts, gpus, identity
from orchestrator.node import placement as placement_mod
from orchestrator.node.procs import Children
from orchestrator.phase_table import Phase
from orchestrator.protocol import faults, fsio
from orchestrator.protocol import lease as lease_mod
from orchestrator.protocol.api import TERMINAL_STATES, Event, HeartbeatState
from orchestrator.protocol.events import EventLog
from orchestrator.protocol.heartbeat import Heartbeat
from orchestrator.protocol.join import (
    Abandoned,
    Admit,
    Enter,
    MasterJoin,
    Rejoin,
    Started,
    TimedOut,
    Wait,
    WorkerJoin,
    WorkerView,
    config_mismatch,
)
from orchestrator.protocol.layout import AttemptLayout, RunLayout
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.membership import Members
from orchestrator.protocol.monitor import Monitor, publish_abort, worker_verdict
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, poll

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Start:
    """What the master published when the attempt started."""

    attempt: str
    iteration: int
    phase: Phase
    plan: dict | None
    hosts: dict[int, str]
    placement: placement_mod.Placement


class Coordinator:
    def __init__(self, config: RunConfig, cancel: CancelToken, children: Children):
        self.config = config
        self.layout = RunLayout(config.log_path)
        self.cancel = cancel
        self.children = children
        self.rank = config.rank
        self.c = config.coordination
        self.backoff = Backoff(self.c.poll_min_s, self.c.poll_max_s)
        self.fault = faults.from_env()
        self.lease: lease_mod.Lease | None = None
        self.attempt_id: str | None = None
        self.heartbeat: Heartbeat | None = None
        self.events: EventLog | None = None
        self.monitor: Monitor | None = None
        self.hosts: dict[int, str] = {}
        self.where: tuple[int | None, str | None] = (None, None)
        self._phase_began = time.monotonic()
        self.gpus = gpus.detect()
        self.placement: placement_mod.Placement | None = None
        """The placement of the ranks in the run now (the attempt's, without out ranks)."""
        self.full_placement: placement_mod.Placement | None = None
        self.out: frozenset[int] = frozenset()
        """Ranks the run goes on without, as the latest barrier released (coordination.elastic)."""
        self.nonce: str | None = None
        self.members = Members()
        """Master: who is out and who came back (attempts/<A>/members.json)."""
        self._nonces: dict[int, str | None] = {}
        """Master: the join nonce of each rank's process in the run."""
        self._members_lock = threading.Lock()
        self.train_round = 0
        """The try of this iteration's training (coordination.elastic: a step redone without a
        rank lost while it trained is round 1, 2, ...)."""
        self._train_released: int | None = None
        """Master: the last iteration whose training it released (no retrain after that)."""
        self._worker_join = WorkerJoin(rank=self.rank, pid=os.getpid(), run=str(self.layout.root), elastic=self.c.elastic)
        self._join_timeout_s: float | None = None

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def attempt(self) -> AttemptLayout:
        assert self.attempt_id is not None
        return self.layout.attempt(self.attempt_id)

    # -- joining ----------------------------------------------------------------------------

    def join(self, resume: Callable[[], tuple[int, Phase, dict | None]],
             prepare: Callable[[int, Phase, dict | None, placement_mod.Placement], None] = lambda *_: None) -> Start:
        """Enter an attempt with every other rank; ``resume`` (master only) says where to
        start, and ``prepare`` (master only) readies the work products for this attempt's
        ranks once all have joined and the placement is known, before the attempt starts."""
        if self.is_master:
            return self._join_as_master(resume, prepare)
        return self._join_as_worker()

    def _enter(self, attempt_id: str, *, rejoin: bool = False) -> None:
        """Write this rank's join record into ``attempt_id``; a rank asking to rejoin a running
        attempt starts its heartbeat only once admitted (until then the master still judges the
        process that went silent)."""
        if self.heartbeat is not None:
            self.heartbeat.close(HeartbeatState.STOPPED)
        if self.events is not None:
            self.events.close()
        self.attempt_id = attempt_id
        self.nonce = uuid.uuid4().hex
        self._worker_join.nonce = self.nonce
        self.events = EventLog(self.attempt.events(self.rank), self.rank)
        self.heartbeat = None
        if rejoin:
            self.attempt.failure(self.rank).unlink(missing_ok=True)  # its own record, of the process the run went on without
        else:
            self._start_heartbeat()
        fsio.write_record(
            self.attempt.join(self.rank),
            {**identity.me(), "rank": self.rank, "attempt": attempt_id, "fingerprint": self.config.fingerprint(), "gpus": self.gpus,
             "doctor": self._quick_facts(), "nonce": self.nonce},
        )

    def _start_heartbeat(self) -> None:
        self.heartbeat = Heartbeat(
            self.attempt.heartbeat(self.rank), rank=self.rank, attempt=self.attempt_id, interval_s=self.c.heartbeat_interval_s
        )
        self.heartbeat.start()

    def _start_monitor(self) -> None:
        self.monitor = Monitor(
            attempt=self.attempt,
            rank=self.rank,
            num_nodes=self.config.num_nodes,
            cancel=self.cancel,
            heartbeat_interval_s=self.c.heartbeat_interval_s,
            node_timeout_s=self.c.node_timeout_s,
            poll_s=min(0.25, self.c.heartbeat_interval_s / 2),
            hosts=self.hosts,
            on_cancel=lambda: self.children.stop_all(grace_s=2.0),
        )
        self.monitor.where = lambda: self.where
        self.monitor.host = identity.host()
        if self.c.elastic:
            self.monitor.on_silent = self._go_on_without if self.is_master else None
            self.monitor.on_members = None if self.is_master else self._members_news
        self.monitor.watch([0] if not self.is_master else [])
        self.monitor.start()

    def _join_as_master(self, resume, prepare) -> Start:
        self.lease = lease_mod.acquire(self.layout, self.c.node_timeout_s, self.c.poll_max_s)
        self._enter(self.lease.attempt)
        log.info("master holds lease generation %d; attempt %s", self.lease.generation, self.attempt_id)
        self.hosts[0] = identity.host()
        self._start_monitor()
        iteration, phase, plan = resume()
        join = MasterJoin(self.attempt_id, self.config.num_nodes, Deadline.after(self.c.join_timeout_s, "ranks to join"))
        if join.missing:
            log.info("waiting for ranks %s to join (up to %.0f s)", _ranks(join.missing), self.c.join_timeout_s)

        def step():
            fsio.refresh_dir(self.attempt.joins)
            action = join.decide({r: fsio.read_record(self.attempt.join(r)) for r in join.missing})
            if isinstance(action, TimedOut):
                raise self._join_timed_out(action.missing)
            if isinstance(action, Admit):
                for r, j in action.joins.items():
                    self.hosts[r] = j["host"]
                    self.monitor.watch([r])
                return True if action.complete else None
            return None

        poll(step, deadline=join.deadline, cancel=self.cancel, backoff=self.backoff,
             on_timeout=lambda: self._join_timed_out(join.missing))
        joins = join.joins
        self._nonces = {r: j.get("nonce") for r, j in joins.items()}
        mine = self.config.fingerprint()
        mismatch = config_mismatch(mine, joins)
        if mismatch is not None:
            r, detail = mismatch
            culprit = Culprit(r, joins[r]["host"], None, None, FailureKind.ERROR, f"configuration differs from the master's ({detail})")
            publish_abort(self.attempt, culprit)
            raise BadInput(f"rank {r} on host {joins[r]['host']} runs a different configuration: {detail}")
        self._preflight(joins)
        reports = {0: {**self.gpus, "host": self.hosts[0]}, **{r: {**j["gpus"], "host": j["host"]} for r, j in joins.items()}}
        self.placement = self.full_placement = self._place(reports)
        prepare(iteration, phase, plan, self.placement)
        start = {
            "attempt": self.attempt_id,
            "iteration": iteration,
            "phase": int(phase),
            "plan": plan,
            "hosts": {str(r): h for r, h in self.hosts.items()},
            "joined": {"0": os.getpid(), **{str(r): j["pid"] for r, j in joins.items()}},
            "nonces": {"0": self.nonce, **{str(r): j.get("nonce") for r, j in joins.items()}},
            "fingerprint": mine,
            "num_nodes": self.config.num_nodes,
            "rl_phase": self.config.rl_phase.value,
            "coordination": {"node_timeout_s": self.c.node_timeout_s, "heartbeat_interval_s": self.c.heartbeat_interval_s},
            "gpus": {str(r): rep for r, rep in sorted(reports.items())},
            "placement": records.to_dict(self.placement),
        }
        fsio.write_record(self.attempt.start, start)
        return Start(self.attempt_id, iteration, phase, plan, dict(self.hosts), self.placement)

    def _join_timed_out(self, missing: tuple[int, ...]) -> PeerFailed:
        first = min(missing)
        return self._abort(Culprit(
            first, self._last_known_host(first), None, None, FailureKind.JOIN,
            f"rank {first} did not join attempt {self.attempt_id} within coordination.join_timeout_s={self.c.join_timeout_s:g} s; "
            f"missing ranks: {_ranks(missing)}. Start them with the same command (--worker R), then re-run"))

    def _quick_facts(self) -> dict | None:
        """What the master's preflight compares (doctor's quick subset: versions, NCCL/Gloo
        settings, interfaces, GPUs, free space); never a reason not to join."""
        try:
            return facts.collect(rank=self.rank, num_nodes=self.config.num_nodes, log_path=self.config.log_path, quick=True,
                                  gpus=self.gpus)
        except Exception as e:  # noqa: BLE001 - a preflight must not stop the run
            log.warning("could not collect this node's facts for the preflight: %s", e)
            return None

    def _preflight(self, joins: dict[int, dict]) -> None:
        """Warn about what usually breaks multi-node runs later (`orchestrator doctor` checks more)."""
        found = {r: j["doctor"] for r, j in joins.items() if j.get("doctor")}
        mine = fsio.read_record(self.attempt.join(0)) or {}
        if mine.get("doctor"):
            found[0] = mine["doctor"]
        try:
            problems = checks.quick_problems(found, checks.Thresholds(node_timeout_s=self.c.node_timeout_s))
        except Exception as e:  # noqa: BLE001
            log.warning("preflight checks failed to run: %s", e)
            return
        for p in problems:
            log.warning("preflight: %s", checks.describe(p))

    def _place(self, reports: dict[int, dict]) -> placement_mod.Placement:
        """The placement for the GPUs the nodes reported, decided once by the master before
        any work; a cluster that does not fit the mappings ends the attempt (exit 2)."""
        train, rollout = self.config.train, self.config.rollout
        try:
            gpus_per_node = placement_mod.cluster_gpus(reports) if train.device_mapping else 0
            resolved = placement_mod.resolve(
                num_nodes=self.config.num_nodes, gpus_per_node=gpus_per_node, train_mapping=train.device_mapping,
                rollout_mapping=rollout.device_mapping, gpus_per_engine=rollout.gpus_per_engine, engine_port=rollout.engine_port,
            )
            placement_mod.rollout_weights(resolved, self.config.rank_weights, [reports[n]["host"] for n in sorted(reports)])
        except ConfigError as e:
            seen = "; ".join(f"node {n} ({r['host']}): {r['count']} GPU(s) ({r['source']})" for n, r in sorted(reports.items()))
            culprit_node = _short_node(reports)
            message = f"the cluster does not fit the GPU placement: {e}. The nodes report: {seen}"
            publish_abort(self.attempt, Culprit(culprit_node, reports[culprit_node]["host"], None, None, FailureKind.ERROR, message))
            raise BadInput(message) from None
        if resolved.on_gpu:
            log.info("placement: %d train worker(s), %d engine(s), %s", len(resolved.train_workers), len(resolved.engines),
                     "colocated" if resolved.colocated else "disaggregated")
        return resolved

    def leave(self, cancel: CancelToken, join_timeout_s: float, *, for_good: bool = True) -> None:
        """A worker leaves the attempt of a master that died, to join the next master's:
        the old attempt is never joined again, and the next join waits ``join_timeout_s``.
        Not ``for_good``: the run went on without this rank, which asks to come back."""
        if self.monitor is not None:
            self.monitor.halt()
            self.monitor = None
        if self.heartbeat is not None:
            self.heartbeat.close(HeartbeatState.FAILED)
            self.heartbeat = None
        if self.events is not None:
            self.events.close()
            self.events = None
        self._worker_join.leave(for_good=for_good)
        self.attempt_id = None
        self.cancel = cancel
        self._join_timeout_s = join_timeout_s

    def _join_as_worker(self) -> Start:
        # The master reports missing ranks at its join deadline; the worker waits a little longer.
        timeout = self._join_timeout_s if self._join_timeout_s is not None else self.c.join_timeout_s
        deadline = Deadline.after(timeout + defaults.WORKER_GRACE_S, "the master to start an attempt")
        join = self._worker_join
        said: set[str] = set()

        def step():
            action = join.decide(self._worker_view(), deadline)
            if isinstance(action, Enter):
                self._check_rank_free(action.lease.attempt)
                self._enter(action.lease.attempt, rejoin=action.rejoin)
                join.joined = action.lease.attempt
                log.info("joined attempt %s of master %s (pid %d)", action.lease.attempt, action.lease.host, action.lease.pid)
                action = join.decide(self._worker_view(), deadline)
            if isinstance(action, (Started, Rejoin)):
                return action
            if isinstance(action, Abandoned):
                raise PeerFailed(action.culprit)
            if isinstance(action, TimedOut):
                raise self._no_master()
            if isinstance(action, Wait) and action.message and action.message not in said:
                said.add(action.message)
                log.info("%s", action.message)
            return None

        action = poll(step, deadline=deadline, cancel=self.cancel, backoff=self.backoff, on_timeout=self._no_master)
        start = action.start
        self.hosts.update({int(r): h for r, h in start["hosts"].items()})
        if start["fingerprint"] != self.config.fingerprint():
            raise BadInput(f"this rank's configuration differs from the master's: master {start['fingerprint']} vs {self.config.fingerprint()}")
        self.placement = self.full_placement = records.from_dict(start["placement"], placement_mod.Placement)
        if isinstance(action, Rejoin):
            iteration = self._await_admission()
            self._start_heartbeat()
            self._start_monitor()
            return Start(start["attempt"], iteration, Phase.SYNC_START, None, dict(self.hosts), self.placement)
        self._start_monitor()
        return Start(start["attempt"], start["iteration"], Phase(start["phase"]), start["plan"], dict(self.hosts), self.placement)

    def _await_admission(self) -> int:
        """Elastic: wait, silent, until the master admits this process back into the running
        attempt at an iteration's start (the iteration returned), for as long as the master
        lives; a run that ends first ends this rank too."""
        log.warning("attempt %s runs without rank %d: asking to rejoin at the next iteration's start", self.attempt_id, self.rank)
        master = LivenessTracker(self.c.node_timeout_s)
        master.watch(0, time.monotonic())

        def probe():
            fsio.refresh_dir(self.attempt.root)
            entry = Members.read(self.attempt.members).admitted.get(self.rank)
            if entry is not None and entry.get("nonce") == self.nonce:
                return entry
            now = time.monotonic()
            beat = fsio.read_record(self.attempt.heartbeat(0))
            master.observe(0, beat, now)
            culprit = worker_verdict(fsio.read_record(self.attempt.abort), master, now, self.hosts)  # what a monitor judges
            if culprit is not None:
                raise PeerFailed(culprit)
            if beat is not None and beat.get("state") in TERMINAL_STATES:
                raise StopRequested(f"the run's master ended ({beat.get('state')}) before rank {self.rank} could rejoin")
            return None

        entry = poll(probe, deadline=Deadline.never("admission into the running attempt"), cancel=self.cancel, backoff=self.backoff)
        log.info("rank %d rejoins attempt %s at iteration %d", self.rank, self.attempt_id, entry["iteration"])
        return entry["iteration"]

    def _worker_view(self) -> WorkerView:
        """One snapshot of the files a joining worker decides on."""
        joined_start = joined_abort = None
        if self.attempt_id is not None:
            fsio.refresh_dir(self.attempt.root)
            joined_abort = fsio.read_record(self.attempt.abort)
            joined_start = fsio.read_record(self.attempt.start)
        lease = lease_mod.read_lease(self.layout)
        if lease is None or lease.released:
            return WorkerView(lease, joined_start=joined_start, joined_abort=joined_abort)
        if lease.attempt == self.attempt_id:
            return WorkerView(lease, joined_start, joined_abort, joined_start, joined_abort)
        attempt = self.layout.attempt(lease.attempt)
        return WorkerView(lease, fsio.read_record(attempt.start), fsio.read_record(attempt.abort), joined_start, joined_abort)

    def _no_master(self) -> PeerFailed:
        return PeerFailed(Culprit(0, "?", None, None, FailureKind.JOIN,
                                  f"no master started an attempt with this rank within coordination.join_timeout_s="
                                  f"{self.c.join_timeout_s:g} s; start rank 0 with --master"))

    def _check_rank_free(self, attempt_id: str) -> None:
        other = fsio.read_record(self.layout.attempt(attempt_id).join(self.rank))
        if other is None or other.get("pid") == os.getpid():
            return
        alive = identity.same_host_process_alive(other)
        if alive:
            raise BadInput(f"rank {self.rank} is already running on host {other['host']} (pid {other['pid']}); each rank runs once")

    def _last_known_host(self, rank: int) -> str:
        return self.hosts.get(rank, "unknown (never joined this attempt)")

    # -- barriers ---------------------------------------------------------------------------

    def set_position(self, iteration: int, phase: Phase, work_deadline: Deadline) -> None:
        """This rank starts ``phase``; its monitor cancels it if the work outlives ``work_deadline``."""
        with self._members_lock:
            self.where = (iteration, phase.label)
            if phase is Phase.TRAIN:
                self._enter_train_round(iteration)
        self.monitor.work_deadline = work_deadline
        self._phase_began = time.monotonic()
        self.events.emit(Event.PHASE, iteration=iteration, phase=int(phase))
        self.heartbeat.update(iteration=iteration, phase=phase.label, state=HeartbeatState.WORKING, progress=None)

    def fault_point(self, action: str, iteration: int, phase: Phase) -> None:
        """Where a test's ORCHESTRATOR_FAULT may hold this rank or make it fail."""
        if self.fault is None or not self.fault.at(action, iteration, int(phase)):
            return
        if action == "raise":
            raise faults.InjectedFault(f"injected failure in phase {phase.label} of iteration {iteration}")
        self._hold()

    def progress(self, done: int, total: int) -> None:
        self.heartbeat.update(progress={"done": done, "total": total})

    def timing(self, part: str, seconds: float, **fields) -> None:
        """Record how long ``part`` of this phase's work took (``status --json``'s ``timing``)."""
        iteration, phase = self._event_position()
        self.events.emit(Event.TIMING, iteration=iteration, phase=phase, part=part, seconds=round(seconds, 4), **fields)

    def took(self, split: str, chunk: int, tasks: int, victim: int) -> None:
        """Record that this rank took chunk ``chunk`` of ``victim``'s first share (work stealing)."""
        iteration, phase = self._event_position()
        self.events.emit(Event.STEAL, iteration=iteration, phase=phase, split=split, chunk=chunk, tasks=tasks, victim=victim)

    def _event_position(self) -> tuple[int | None, int | None]:
        """(iteration, phase number) of this rank now, as events record them."""
        iteration, label = self.where
        return iteration, int(label.split(":")[0]) if label else None

    def barrier(
        self, iteration: int, phase: Phase, payload: dict | None, deadline: Deadline,
        decide: Callable[[dict[int, dict]], dict],
    ) -> dict:
        """Arrive, wait for everyone, and return the master's decision for this phase."""
        self.cancel.check()  # a rank cancelled during its work must not arrive
        self.monitor.work_deadline = None  # from here on the barrier's own deadline applies
        fsio.write_record(
            self.attempt.arrive(self.rank),
            {"attempt": self.attempt_id, "iteration": iteration, "phase": int(phase), **self._round(phase), "payload": payload or {}},
        )
        arrived = time.monotonic()
        self.events.emit(Event.ARRIVE, iteration=iteration, phase=int(phase), work_s=round(arrived - self._phase_began, 4),
                         payload=_counts(payload))
        self.heartbeat.update(state=HeartbeatState.WAITING)
        self.fault_point("hold-after-arrive", iteration, phase)
        if self.is_master:
            decision = self._release(iteration, phase, deadline, decide)
            self.events.emit(Event.RELEASED, iteration=iteration, phase=int(phase), wait_s=round(time.monotonic() - arrived, 4))
            return decision
        def probe():
            fsio.refresh_dir(self.attempt.root)
            return _matching(fsio.read_record(self.attempt.release), iteration, phase, self._round_at(phase))

        release = poll(
            probe,
            deadline=deadline.extended(defaults.WORKER_GRACE_S),
            cancel=self.cancel,
            backoff=self.backoff,
            on_timeout=lambda: self._deadline(iteration, phase, f"the master did not release {phase.label} in time", culprit_rank=0),
        )
        self.events.emit(Event.RELEASED, iteration=iteration, phase=int(phase), wait_s=round(time.monotonic() - arrived, 4))
        if "out" in release["decision"]:
            self._apply_out(release["decision"]["out"])
        return release["decision"]

    def _release(self, iteration, phase, deadline, decide) -> dict:
        arrivals: dict[int, dict] = {}
        missing = set(range(self.config.num_nodes)) - self.monitor.out

        def probe():
            if self.c.elastic:
                if phase is Phase.SYNC_START:
                    missing.update(self._admit_returning(iteration))
                for r in self.monitor.out & (missing | set(arrivals)):  # the run went on without it
                    missing.discard(r)
                    arrivals.pop(r, None)
            fsio.refresh_dir(self.attempt.arrivals)
            for r in sorted(missing):
                a = fsio.read_record(self.attempt.arrive(r))
                if a is not None and a.get("attempt") == self.attempt_id and _matching(a, iteration, phase, self._round_at(phase)):
                    arrivals[r] = a["payload"]
                    missing.discard(r)
            return True if not missing else None

        poll(
            probe,
            deadline=deadline,
            cancel=self.cancel,
            backoff=self.backoff,
            on_timeout=lambda: self._deadline(
                iteration, phase,
                f"barrier {phase.label} still waits for ranks {_ranks(missing)} after deadlines.{phase.name.lower()}",
                culprit_rank=min(missing),
            ),
        )
        self.events.emit(Event.ALL_ARRIVED, iteration=iteration, phase=int(phase))
        if self.c.elastic and phase is Phase.TRAIN:
            with self._members_lock:  # a rank lost from here on does not undo the finished step
                self.cancel.check()
                self._train_released = iteration
        if self.c.elastic:
            out = sorted(self.monitor.out)
            self._apply_out(out)  # the decision (the plan, the training group) is made for these ranks
        self.monitor.work_deadline = deadline  # the decision is the master's work: bound it too
        decision = decide(arrivals)
        if self.c.elastic:
            decision = {**decision, "out": out}
        self.monitor.work_deadline = None
        if self.monitor is not None and self.monitor.stop_requested is not None:
            decision = {**decision, "stop": self.monitor.stop_requested}
        fsio.write_record(self.attempt.release, {"iteration": iteration, "phase": int(phase), **self._round(phase), "decision": decision})
        fsio.write_record(self.layout.progress, {"iteration": iteration, "phase": int(phase), "attempt": self.attempt_id})
        return decision

    # -- elastic membership -------------------------------------------------------------------

    def _apply_out(self, out) -> None:
        """The ranks in the run from this barrier on: the placement without the others."""
        out = frozenset(out)
        if out != self.out:
            self.out = out
            self.placement = self.full_placement.without(out) if out else self.full_placement

    def _go_on_without(self, culprit: Culprit) -> bool:
        """Master's monitor, elastic: a worker went silent past the node timeout. Mark it out
        and go on, unless too few ranks would be left: then the attempt ends as without
        elastic. Lost while the group trains (phase 10, not yet released), the step is
        trained again without it: a new round, which cancels every rank's try of it."""
        rank = culprit.rank
        with self._members_lock:
            out = set(self.members.out) | {rank}
            left = self.config.num_nodes - len(out)
            iteration, phase = self.where
            if left < self.c.min_nodes:
                log.error("rank %d went silent and only %d rank(s) would be left, fewer than coordination.min_nodes=%d: "
                          "the attempt ends", rank, left, self.c.min_nodes)
                return False
            if not self.full_placement.without(out).train_workers:
                log.error("rank %d went silent and the ranks left hold no train worker: the attempt ends", rank)
                return False
            self.members.mark_out(rank, iteration=culprit.iteration, phase=culprit.phase, host=culprit.host, reason=culprit.error,
                                  nonce=self._nonces.get(rank))
            retrain = phase == Phase.TRAIN.label and self._train_released != iteration
            if retrain:
                self.members.declare_round(iteration, self.train_round + 1)
            self.members.write(self.attempt.members)
        self.monitor.forget(rank)
        self.events.emit(Event.OUT, iteration=culprit.iteration, phase=culprit.phase, who=rank, reason=culprit.error)
        survivors = self._ranks_in(out)
        work = "they train this step again without it" if retrain else "its unfinished rollout work goes to them"
        log.warning("%s. coordination.elastic: the run goes on with ranks %s; %s. "
                    "Start the same command on that node to rejoin at the next iteration's start", culprit.describe(), survivors, work)
        if retrain and self.cancel.cancel(Retrain(f"rank {rank} was lost while iteration {iteration} trained: ranks {survivors} "
                                                  f"train it again (round {self.train_round + 1}) from the same checkpoint")):
            self.monitor.on_cancel()
        return True

    def _enter_train_round(self, iteration: int) -> None:
        """Elastic, at each start of phase 10 (holding the members lock): the round of this
        iteration's training and the ranks it trains with. The master declares a new round
        when a rank went out since the last release (lost between it and this training)."""
        if not self.c.elastic:
            return
        if self.is_master:
            members = self.members
        else:
            fsio.refresh_dir(self.attempt.root)
            members = Members.read(self.attempt.members)
        declared = members.round_of(iteration)
        round_, out = declared if declared is not None else (0, self.out)
        if self.is_master and frozenset(members.out) != out:
            round_, out = round_ + 1, frozenset(members.out)
            members.declare_round(iteration, round_)
            members.write(self.attempt.members)
        self.train_round = round_
        self._apply_out(out)
        if round_:
            log.warning("training iteration %d again (round %d) with ranks %s", iteration, round_, self._ranks_in(out))

    def _members_news(self, members: Members) -> OrchestratorError | None:
        """Worker's monitor, elastic: what the master's membership record means for this process."""
        iteration, phase = self.where
        if members.is_out(self.rank, self.nonce):
            return MarkedOut(f"rank {self.rank} on host {identity.host()} was silent past coordination.node_timeout_s at iteration "
                             f"{iteration}, phase {phase}, and the run went on without it: stopping its work; it rejoins at "
                             f"the next iteration's start")
        declared = members.round_of(iteration) if phase == Phase.TRAIN.label else None
        if declared is not None and declared[0] > self.train_round:
            lost = _ranks(declared[1] - self.out)
            return Retrain(f"rank(s) {lost} were lost while iteration {iteration} trained: training it again (round {declared[0]}) "
                           f"from the same checkpoint without them")
        return None

    def _ranks_in(self, out) -> str:
        """The ranks in the run without ``out``, as log lines name them."""
        return _ranks(r for r in range(self.config.num_nodes) if r not in out)

    def _round_at(self, phase: Phase) -> int:
        """The training round a barrier of ``phase`` belongs to: phase 10's try, else 0."""
        return self.train_round if phase is Phase.TRAIN else 0

    def _round(self, phase: Phase) -> dict:
        """The round field of a barrier record: phase 10's after a retrain, else none."""
        return {"round": r} if (r := self._round_at(phase)) else {}

    def rearm(self, cancel: CancelToken) -> None:
        """Go on with ``cancel`` after a retrain ended the old token (its monitor with it)."""
        self.cancel = cancel
        if self.monitor is not None:
            self.monitor.rearm(cancel)

    def _admit_returning(self, iteration: int) -> list[int]:
        """Master, at an iteration's start: admit the out ranks whose process asks to come back
        (a join record with another nonce than the one that went silent) and runs the same
        configuration. Returns the ranks admitted."""
        admitted = []
        with self._members_lock:
            if not self.members.out:
                return []
            fsio.refresh_dir(self.attempt.joins)
            for rank in sorted(self.members.out):
                join = fsio.read_record(self.attempt.join(rank))
                if not self.members.wants_back(rank, join) or join.get("attempt") != self.attempt_id:
                    continue
                mismatch = config_mismatch(self.config.fingerprint(), {rank: join})
                if mismatch is not None:
                    log.warning("rank %d asks to rejoin with another configuration (%s): not admitted", rank, mismatch[1])
                    continue
                self.members.admit(rank, iteration=iteration, host=join["host"], nonce=join["nonce"])
                self._nonces[rank] = join["nonce"]
                self.hosts[rank] = join["host"]
                admitted.append(rank)
            if admitted:
                self.members.write(self.attempt.members)
        for rank in admitted:
            self.monitor.watch([rank])
            self.events.emit(Event.REJOINED, iteration=iteration, phase=int(Phase.SYNC_START), who=rank)
            log.warning("rank %d on host %s rejoins the run at iteration %d", rank, self.hosts[rank], iteration)
        return admitted

    def _deadline(self, iteration, phase, message, culprit_rank: int | None = None):
        rank = self.rank if culprit_rank is None else culprit_rank
        culprit = Culprit(rank, self.hosts.get(rank, "?"), iteration, phase.label, FailureKind.DEADLINE, message)
        if self.is_master:
            publish_abort(self.attempt, culprit)
        return DeadlineExceeded(culprit.describe())

    def _abort(self, culprit: Culprit) -> PeerFailed:
        publish_abort(self.attempt, culprit)
        return PeerFailed(culprit)

    def _hold(self) -> None:
        log.warning("fault injection: holding at %s", self.where)
        self.heartbeat.update(state=HeartbeatState.HELD)
        self.cancel.sleep(faults.HOLD_LIMIT_S)

    # -- ending -----------------------------------------------------------------------------

    def record_failure(self, kind: FailureKind, error: str, exc: BaseException | None = None, culprit: Culprit | None = None) -> None:
        """Write this rank's failure record (and, on the master, the attempt's abort)."""
        if self.attempt_id is None:
            return
        iteration, phase = self.where
        body = {
            **identity.me(),
            "rank": self.rank,
            "iteration": iteration,
            "phase": phase,
            "kind": kind,
            "error": error,
            "traceback": "".join(traceback.format_exception(exc))[-4000:] if exc is not None else None,
            "culprit": records.to_dict(culprit) if culprit is not None else None,
            "child": exc.child if isinstance(exc, ChildFailed) else None,
            "at": time.time(),
        }
        if self.events is not None:
            self.events.emit(Event.ERROR, iteration=iteration, phase=phase, kind=kind, error=error[:2000],
                             culprit=culprit.rank if culprit is not None else None)
        try:
            fsio.write_record(self.attempt.failure(self.rank), body)
            if self.is_master and kind in ROOT_CAUSE_KINDS:
                publish_abort(self.attempt, Culprit(self.rank, body["host"], iteration, phase, kind, error, body["child"]))
        except OSError as e:
            log.error("could not write the failure record: %s", e)

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


def _matching(record: dict | None, iteration: int, phase: Phase, round_: int = 0) -> dict | None:
    if record is None or record.get("iteration") != iteration or record.get("phase") != int(phase):
        return None
    return record if record.get("round", 0) == round_ else None


def _short_node(reports: dict[int, dict]) -> int:
    """The node to blame: the one with the fewest GPUs when counts differ, else node 0."""
    counts = {n: r["count"] for n, r in reports.items()}
    if len(set(counts.values())) > 1:
        return min(counts, key=lambda n: (counts[n], n))
    return 0


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in sorted(ranks))
