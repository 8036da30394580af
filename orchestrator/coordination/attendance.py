"""A rank's presence in an attempt: joining it, rejoining it, leaving it; and what a rank
runs while it is in one (its heartbeat, its event log, its monitor).

Joining. The master takes the lease (``coordination/master_lease.py``), which names a fresh
attempt ``A``; every rank writes ``attempts/A/joins/r<R>.json``; the master reads those N
known names, checks that all ranks run the same configuration, runs the preflight
(``coordination/startup.py``) and the placement (``node/placement.py``), and publishes
``attempts/A/start.json`` with the resume point. A
worker finds ``A`` by polling ``control/lease.json``, and follows the lease if a new master
starts a new attempt while it waits. What to do at each read is decided in
``protocol/join.py`` (and ``lease.Takeover``); this module reads, writes and carries it out,
its waits run by the executor (``coordination/executor.py``).
The coordinator (``coordination/coordinator.py``) builds on it with barriers and membership.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from orchestrator import defaults
from orchestrator.config import RunConfig
from orchestrator.coordination import executor, master_lease, startup, wakeup
from orchestrator.coordination.heartbeat import Heartbeat
from orchestrator.coordination.monitor import Monitor, publish_abort
from orchestrator.errors import BadInput, Culprit, DeadlineExceeded, FailureKind, PeerFailed, RunFinished, StopRequested
from orchestrator.node import gpus, identity
from orchestrator.node import placement as placement_mod
from orchestrator.node.placement import Placement
from orchestrator.node.procs import Children
from orchestrator.phase_table import Phase
from orchestrator.protocol import faults, fsio, records, schedule, schema
from orchestrator.protocol import lease as lease_mod
from orchestrator.protocol.actions import Wait
from orchestrator.protocol.events import EventLog
from orchestrator.protocol.join import (
    Abandoned,
    Admit,
    Enter,
    Finished,
    MasterJoin,
    Rejoin,
    Started,
    WorkerJoin,
    WorkerView,
    config_mismatch,
)
from orchestrator.protocol.layout import AttemptLayout, RunLayout
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.membership import Members, ranks_text
from orchestrator.protocol.verdicts import worker_verdict
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline
from orchestrator.protocol.wire import TERMINAL_STATES, HeartbeatState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Entry:
    """Where this rank enters the attempt's walk (a rank admitted back: the iteration's start)."""

    attempt: str
    iteration: int
    phase: Phase
    plan: dict | None
    training: tuple[schema.TrainingPlan, ...] = ()
    """The training plans released and not yet published where the attempt starts."""
    rejoined: bool = False
    """Admitted back into a running attempt (elastic), not at its start."""


class Attendance:
    """The base of ``Coordinator``, which adds the membership rules the monitor reports to
    (``_go_on_without``, ``_members_news``) and the group a worker leads (``_led_group``)."""

    def __init__(self, config: RunConfig, cancel: CancelToken, children: Children):
        self.config = config
        self.layout = RunLayout(config.log_path)
        self.cancel = cancel
        self.children = children
        self.rank = config.rank
        self.c = config.coordination
        self.backoff = Backoff(self.c.poll_min_s, self.c.poll_max_s)
        self.idle_backoff = Backoff(self.c.poll_min_s, max(self.c.poll_min_s, self.c.watch_s))
        """A worker's long waits (for the master: to start an attempt, to release a barrier, to
        admit it back): many ranks poll the master's files, so at most once a watch interval."""
        self.lease: lease_mod.Lease | None = None
        self.attempt_id: str | None = None
        self.heartbeat: Heartbeat | None = None
        self.events: EventLog | None = None
        self.monitor: Monitor | None = None
        self.hosts: dict[int, str] = {}
        self.where: tuple[int | None, Phase | None] = (None, None)
        self.gpus = gpus.detect()
        self.placement: Placement | None = None
        """The placement of the ranks in the run now (the attempt's, without out ranks)."""
        self.full_placement: Placement | None = None
        self.nonce: str | None = None
        self._nonces: dict[int, str | None] = {}
        """Master: the join nonce of each rank's process in the run."""
        self._members_lock = threading.Lock()
        self._worker_join = WorkerJoin(rank=self.rank, pid=os.getpid(), run=str(self.layout.root), elastic=self.c.elastic)
        self._join_timeout_s: float | None = None
        self.fault = faults.from_env()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def attempt(self) -> AttemptLayout:
        assert self.attempt_id is not None
        return self.layout.attempt(self.attempt_id)

    def finished(self) -> schema.Progress | None:
        """The last released barrier when the run has no phase left under this configuration
        (``--rl-phase``, ``--max-iterations``); None while it has."""
        fsio.refresh_dir(self.layout.control)
        progress = schema.read(self.layout.progress, schema.Progress)
        return progress if schedule.finished(progress, self.config.rl_phase, self.config.max_iterations) else None

    def join(self, resume: Callable[[], tuple[int, Phase, dict | None, tuple[schema.TrainingPlan, ...]]],
             prepare: Callable[[int, Phase, dict | None, Placement], None] = lambda *_: None) -> Entry:
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
             "doctor": startup.quick_facts(self.config, self.gpus), "nonce": self.nonce},
        )

    def _start_heartbeat(self) -> None:
        self.heartbeat = Heartbeat(
            self.attempt.heartbeat(self.rank), rank=self.rank, attempt=self.attempt_id, interval_s=self.c.heartbeat_interval_s
        )
        self.heartbeat.start()

    def _start_monitor(self) -> None:
        self.monitor = Monitor(
            attempt=self.attempt, rank=self.rank, cancel=self.cancel,
            heartbeat_interval_s=self.c.heartbeat_interval_s, node_timeout_s=self.c.node_timeout_s,
            watch_interval_s=self.c.watch_s, hosts=self.hosts,
            on_cancel=lambda: self.children.stop_all(grace_s=2.0),
        )
        self.monitor.heartbeat = self.heartbeat
        self.monitor.where = lambda: self.where
        self.monitor.fan_in = self.fan_in
        self.monitor.leads = self._led_group
        self.monitor.host = identity.host()
        if self.c.elastic:
            self.monitor.on_silent = self._go_on_without if self.is_master else None
            self.monitor.on_members = None if self.is_master else self._members_news
        self.monitor.watch([0] if not self.is_master else [])
        self.monitor.start()

    def _join_as_master(self, resume, prepare) -> Entry:
        self.lease = master_lease.acquire(self.layout, self.c.node_timeout_s, self.c.poll_max_s, self.cancel)
        self._enter(self.lease.attempt)
        log.info("master holds lease generation %d; attempt %s", self.lease.generation, self.attempt_id)
        self.hosts[0] = identity.host()
        self._start_monitor()
        iteration, phase, plan, training = resume()
        join = MasterJoin(self.attempt_id, self.config.num_nodes, Deadline.after(self.c.join_timeout_s, "ranks to join"))
        if join.missing:
            log.info("waiting for ranks %s to join (up to %.0f s)", ranks_text(join.missing), self.c.join_timeout_s)

        def decide():
            fsio.refresh_dir(self.attempt.joins)
            return join.decide({r: fsio.read_record(self.attempt.join(r)) for r in join.missing})

        def admit(action: Admit) -> bool | None:
            for r, j in action.joins.items():
                self.hosts[r] = j["host"]
                self.monitor.watch([r])
            return True if action.complete else None

        executor.run(executor.Operation(decide, lambda action: self._join_timed_out(action.missing if action else join.missing), admit),
                     join.deadline, cancel=self.cancel, backoff=self.backoff,
                     pace=lambda: (len(join.missing) + 1) / defaults.MASTER_READS_PER_S)  # a read of every missing join
        joins = join.joins
        self._nonces = {r: j.get("nonce") for r, j in joins.items()}
        mine = self.config.fingerprint()
        mismatch = config_mismatch(mine, joins)
        if mismatch is not None:
            r, detail = mismatch
            culprit = Culprit(r, joins[r]["host"], None, None, FailureKind.ERROR, f"configuration differs from the master's ({detail})")
            publish_abort(self.attempt, culprit, self.heartbeat)
            raise BadInput(f"rank {r} on host {joins[r]['host']} runs a different configuration: {detail}")
        startup.preflight({0: fsio.read_record(self.attempt.join(0)) or {}, **joins}, self.c.node_timeout_s)
        reports = {0: {**self.gpus, "host": self.hosts[0]}, **{r: {**j["gpus"], "host": j["host"]} for r, j in joins.items()}}
        try:
            self.placement = self.full_placement = placement_mod.place(
                num_nodes=self.config.num_nodes, rank_weights=self.config.rank_weights, train=self.config.train,
                rollout=self.config.rollout, max_staleness=self.config.rl.max_staleness, reports=reports,
                models=self.config.models)
        except placement_mod.Unplaceable as e:
            publish_abort(self.attempt, e.culprit, self.heartbeat)
            raise BadInput(e.culprit.error) from None
        prepare(iteration, phase, plan, self.placement)
        schema.write(self.attempt.start, schema.Start(
            attempt=self.attempt_id, iteration=iteration, phase=phase, plan=plan, hosts=dict(self.hosts),
            joined={0: os.getpid(), **{r: j["pid"] for r, j in joins.items()}},
            nonces={0: self.nonce, **{r: j.get("nonce") for r, j in joins.items()}},
            fingerprint=mine, num_nodes=self.config.num_nodes, rl_phase=self.config.rl_phase.value,
            coordination={"node_timeout_s": self.c.node_timeout_s, "heartbeat_interval_s": self.c.heartbeat_interval_s},
            gpus=dict(sorted(reports.items())), placement=records.to_dict(self.placement), training=training,
        ))
        return Entry(self.attempt_id, iteration, phase, plan, training)

    def _join_timed_out(self, missing: tuple[int, ...]) -> PeerFailed:
        first = min(missing)
        culprit = Culprit(
            first, self.hosts.get(first, "unknown (never joined this attempt)"), None, None, FailureKind.JOIN,
            f"rank {first} did not join attempt {self.attempt_id} within coordination.join_timeout_s={self.c.join_timeout_s:g} s; "
            f"missing ranks: {ranks_text(missing)}. Start them with the same command (--worker R), then re-run")
        publish_abort(self.attempt, culprit, self.heartbeat)
        return PeerFailed(culprit)

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

    def _join_as_worker(self) -> Entry:
        # The master reports missing ranks at its join deadline; the worker waits a little longer.
        timeout = self._join_timeout_s if self._join_timeout_s is not None else self.c.join_timeout_s
        deadline = Deadline.after(timeout + defaults.WORKER_GRACE_S, "the master to start an attempt")
        join = self._worker_join
        # A master on this host wakes the wait at once: control/ made, its lease, then the attempt's start.
        wakes = wakeup.Wakeups()
        wakes.watch(self.layout.root, [self.layout.control.name])
        lease_watched = False

        def decide():
            nonlocal lease_watched
            lease_watched = lease_watched or wakes.watch(self.layout.control, ["lease.json"])
            action = join.decide(self._worker_view(), deadline)
            if isinstance(action, Enter):  # entered, the rank decides again at once: the attempt may have started
                self._check_rank_free(action.lease.attempt)
                self._enter(action.lease.attempt, rejoin=action.rejoin)
                join.joined = action.lease.attempt
                log.info("joined attempt %s of master %s (pid %d)", action.lease.attempt, action.lease.host, action.lease.pid)
                if action.lease.host == identity.host():
                    wakes.watch(self.attempt.root, ["start.json", "abort.json"])
                action = join.decide(self._worker_view(), deadline)
            return action

        def act(action) -> Started | Rejoin:
            if isinstance(action, Abandoned):
                raise PeerFailed(action.culprit)
            if isinstance(action, Finished):
                raise RunFinished(f"the run under {self.layout.root} is complete and no master holds it: nothing is left for "
                                  f"rank {self.rank} (the run completed without it)")
            if isinstance(action, (Started, Rejoin)):
                return action
            return None  # entered again (a new master's attempt, say): read again

        with wakes:
            action = executor.run(executor.Operation(decide, lambda _: self._no_master(), act), deadline, cancel=self.cancel,
                                  backoff=self.idle_backoff, wake=wakes.event)
        start = records.from_dict(action.start, schema.Start, str_keys=True)
        self.hosts.update(start.hosts)
        if start.fingerprint != self.config.fingerprint():
            raise BadInput(f"this rank's configuration differs from the master's: master {start.fingerprint} vs {self.config.fingerprint()}")
        self.placement = self.full_placement = records.from_dict(start.placement, Placement)
        if isinstance(action, Rejoin):
            iteration = self._await_admission()
            self._start_heartbeat()
            self._start_monitor()
            return Entry(start.attempt, iteration, Phase.SYNC_START, None, rejoined=True)
        self._start_monitor()
        return Entry(start.attempt, start.iteration, start.phase, start.plan, start.training)

    def _await_admission(self) -> int:
        """Elastic: wait, silent, until the master admits this process back into the running
        attempt at an iteration's start (the iteration returned), for as long as the master
        lives; a run that ends first ends this rank too."""
        log.warning("attempt %s runs without rank %d: asking to rejoin at the next iteration's start", self.attempt_id, self.rank)
        master = LivenessTracker(self.c.node_timeout_s)
        master.watch(0, time.monotonic())

        def decide():
            fsio.refresh_dir(self.attempt.root)
            entry = Members.read(self.attempt.members).admitted.get(self.rank)
            if entry is not None and entry.get("nonce") == self.nonce:
                return entry  # admitted: the wait is over
            now = time.monotonic()
            beat = fsio.read_record(self.attempt.heartbeat(0))
            master.observe(0, beat, now)
            culprit = worker_verdict(fsio.read_record(self.attempt.abort), master, now, self.hosts)  # what a monitor judges
            if culprit is not None:
                raise PeerFailed(culprit)
            if beat is not None and beat.get("state") == HeartbeatState.DONE:
                raise RunFinished(f"the run's master finished the run before rank {self.rank} could rejoin: it completed without it")
            if beat is not None and beat.get("state") in TERMINAL_STATES:
                raise StopRequested(f"the run's master ended ({beat.get('state')}) before rank {self.rank} could rejoin")
            return Wait()

        never = Deadline.never("admission into the running attempt")
        entry = executor.run(executor.Operation(decide, lambda _: DeadlineExceeded(f"timed out waiting for {never.what}")), never,
                             cancel=self.cancel, backoff=self.idle_backoff)
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
            return WorkerView(lease, joined_start=joined_start, joined_abort=joined_abort, finished=self.finished() is not None)
        if lease.attempt == self.attempt_id:
            return WorkerView(lease, joined_start, joined_abort, joined_start, joined_abort)
        attempt = self.layout.attempt(lease.attempt)
        return WorkerView(lease, fsio.read_record(attempt.start), fsio.read_record(attempt.abort), joined_start, joined_abort)

    def _no_master(self) -> PeerFailed:
        return PeerFailed(Culprit(0, "?", None, None, FailureKind.JOIN,
                                  f"no master started an attempt with this rank within coordination.join_timeout_s="
                                  f"{self.c.join_timeout_s:g} s; start rank 0 with --master"))

    def _check_rank_free(self, attempt_id: str) -> None:
        """Refuse to enter ``attempt_id`` where another live process of this host joined it as
        this rank. The rank lock (``node/rank_lock.py``) refuses that process at its start
        already; this read catches what the lock cannot see: a process of another user, or
        one whose ``TMPDIR`` (and so lock directory) differs."""
        other = fsio.read_record(self.layout.attempt(attempt_id).join(self.rank))
        if other is None or other.get("pid") == os.getpid():
            return
        if identity.same_host_process_alive(other):
            raise BadInput(f"rank {self.rank} is already running on host {other['host']} (pid {other['pid']}); each rank "
                           f"runs once: stop it first, or start this node as another rank (--worker R)")
