"""The watcher thread of a rank: it notices a failed, dead or stopped peer while the main
thread is busy, and cancels the rank at once.

A worker reads one file, the master's heartbeat, once every ``coordination.watch_interval_s``
(:class:`MasterWord`): its counter says the master lives, and the master adds to it what a
worker must act on: ``abort`` (the attempt ended: the worker then reads ``abort.json`` for
the root cause), ``released`` (the last barrier point it released: a waiting worker then
reads ``release.json``) and ``members`` (how many times it rewrote ``members.json``, which
the worker reads again only then). A waiting worker's barrier polls go through the same
reader, so watching and waiting together cost one open by name per read.

With barriers that fan in (coordination.fan_in), each group's leader also reads its
members' heartbeats once per heartbeat interval and writes them, with its own, in one file
(``heartbeats/g<G>.json``); the master then reads the group files, twice an interval, and
reads by name only the ranks of a group whose file is missing, stands still (its leader
died or froze: its members are then judged from their own files, the leader with them) or
was written by a rank that no longer leads it.

The master reads each rank's heartbeat once per heartbeat interval (or through the group
files), lists the failures
directory every poll (one listing, not a file per rank; a rank whose heartbeat says it
failed has its record read by name too, since a listing can be stale on some FUSE
filesystems), and turns what it sees into one ``abort.json`` naming the root cause.

Deciding is separate from doing: the verdicts are pure functions of what was read
(protocol/verdicts.py); :class:`Monitor` does the reading, writing and cancelling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from orchestrator.protocol import records
from orchestrator.errors import Culprit, DeadlineExceeded, FailureKind, OrchestratorError, PeerFailed
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.wire import TERMINAL_STATES
from orchestrator.protocol.barrier import FanIn
from orchestrator.protocol.layout import AttemptLayout
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.schema import Members
from orchestrator.protocol.verdicts import master_verdict, poll_interval_s, worker_verdict
from orchestrator.protocol.waiting import CancelToken, Deadline

log = logging.getLogger(__name__)


class MasterWord:
    """A worker's reading of the master's heartbeat, shared by its monitor and its barrier
    waits: a read younger than ``max_age_s`` is not made again."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._body: dict | None = None

    def read(self, max_age_s: float = 0.0) -> dict | None:
        with self._lock:
            now = self._clock()
            if now - self._read_at >= max_age_s:
                self._body = fsio.read_record(self.path)
                if self._body is None:  # not there yet (a fresh attempt on NFS): look at the directory again
                    fsio.refresh_dir(self.path.parent)
                    self._body = fsio.read_record(self.path)
                self._read_at = now
            return self._body


class Monitor:
    """Runs the verdict for this rank's role every poll and cancels the rank on one."""

    def __init__(
        self,
        *,
        attempt: AttemptLayout,
        rank: int,
        cancel: CancelToken,
        heartbeat_interval_s: float,
        node_timeout_s: float,
        watch_interval_s: float,
        hosts: dict[int, str],
        on_cancel: Callable[[], None],
    ):
        self.attempt = attempt
        self.rank = rank
        self.cancel = cancel
        self.hb_every = heartbeat_interval_s
        self.poll_s = poll_interval_s(heartbeat_interval_s) if rank == 0 else watch_interval_s
        self.word = MasterWord(attempt.heartbeat(0))
        """Worker: the master's heartbeat, as last read (by the monitor or a barrier wait)."""
        self.heartbeat = None
        """This rank's heartbeat: the master's carries ``abort`` once it published one."""
        self._members: Members | None = None
        self._members_version: object = None
        self.hosts = hosts
        self.on_cancel = on_cancel
        self.tracker = LivenessTracker(node_timeout_s)
        self.stop_requested: dict | None = None
        self.work_deadline: Deadline | None = None
        self.where: Callable[[], tuple[int | None, Phase | None]] = lambda: (None, None)
        self.host = hosts.get(rank, "?")
        self.out: frozenset[int] = frozenset()
        """Ranks the run went on without (coordination.elastic): neither their heartbeats nor
        their failure records concern this attempt any more. Replaced, never changed in place:
        other threads read it without the lock."""
        self.on_silent: Callable[[Culprit], bool] | None = None
        """Master, elastic: offered each worker that went silent; True when the run goes on without it."""
        self.fan_in: FanIn | None = None
        """The worker groups whose leaders pass heartbeats on (coordination.fan_in)."""
        self.leads: Callable[[], int | None] = lambda: None
        """Worker: the group it leads now, if any (then it passes its members' heartbeats on)."""
        self._groups = LivenessTracker(2 * heartbeat_interval_s)
        """Master: when each group's heartbeat file last changed (it stands still past two
        intervals: its members are read by name)."""
        self._relayed = 0
        self.on_members: Callable[[Members], OrchestratorError | None] | None = None
        """Worker, elastic: judges the master's membership record each poll; what it returns
        (the run went on without this process, or the training step is redone) cancels the rank."""
        self._next_hb = 0.0
        """When it reads heartbeats next (the master: the ranks' or the groups'; a leader: its members')."""
        self._new_thread()
        self._lock = threading.Lock()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def forget(self, rank: int) -> None:
        """Stop judging ``rank`` (the master marked it out)."""
        with self._lock:
            self.out = self.out | {rank}
            self.tracker.forget(rank)

    def watch(self, ranks) -> None:
        """Start judging these ranks' heartbeats (the master adds ranks as they join)."""
        now = time.monotonic()
        with self._lock:
            for r in ranks:
                if r != self.rank:
                    self.out = self.out - {r}
                    self.tracker.watch(r, now)

    def _new_thread(self) -> None:
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def rearm(self, cancel: CancelToken) -> None:
        """Watch on for ``cancel`` after the old token ended this thread (a training step
        redone, coordination.elastic); what it knows of the ranks stays."""
        self.halt()
        self.cancel = cancel
        self._new_thread()
        self._thread.start()

    def halt(self) -> None:
        self._halt.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._halt.is_set() and self.cancel.reason is None:
            if self.step(time.monotonic()):
                return
            self._halt.wait(self.poll_s)

    def step(self, now: float) -> bool:
        """One look: read what this rank's role reads, and act on a verdict. True when it
        ended the watch (the rank is cancelled); the thread calls it every ``poll_s``."""
        beat = None
        try:
            if not self.is_master:
                verdict, beat = self._watch_master(now)
                if now >= self._next_hb:
                    self._next_hb = now + self.hb_every
                    self._pass_heartbeats_on()
            else:
                if now >= self._next_hb:
                    self._read_heartbeats(now)
                    self._next_hb = now + (self.hb_every if self.fan_in is None else self.hb_every / 2)
                verdict = self._verdict(now)
        except OSError as e:
            log.warning("monitor could not read the shared filesystem: %s", e)
            verdict = None
        if verdict is not None:
            self._end_attempt(verdict)
            return True
        try:
            news = self.on_members(self._members_now(beat)) if self.on_members is not None else None
        except OSError:
            news = None
        if news is not None:
            log.error("%s", news)
            if self.cancel.cancel(news):
                self.on_cancel()
            return True
        deadline = self.work_deadline
        if deadline is not None and deadline.expired():
            self._overran(deadline)
            return True
        return False

    def _read_heartbeats(self, now: float) -> None:
        """Master: every watched rank's heartbeat, one open by name each (a heartbeat exists
        from the rank's join on and is replaced by rename: no directory refresh needed), or
        through the group files."""
        with self._lock:
            watched = self.tracker.watched()
            for r in watched if self.fan_in is None else self._read_groups(now, watched):
                self.tracker.observe(r, fsio.read_record(self.attempt.heartbeat(r)), now)

    def _read_groups(self, now: float, watched: list[int]) -> list[int]:
        """Master: observe the ranks the group files carry; return those to read by name."""
        by_group: dict[int, list[int]] = {}
        for r in watched:
            by_group.setdefault(self.fan_in.group(r), []).append(r)
        direct = []
        for group, ranks in sorted(by_group.items()):
            record = fsio.read_record(self.attempt.group_heartbeat(group))
            self._groups.observe(group, record, now)
            beats = (record or {}).get("beats") or {}
            if record is None or group in self._groups.dead(now) or record.get("leader") != self.fan_in.leader(group, self.out):
                direct += ranks
                continue
            for r in ranks:
                if str(r) in beats:
                    self.tracker.observe(r, beats[str(r)], now)
                else:
                    direct.append(r)
        return direct

    def _pass_heartbeats_on(self) -> None:
        """Worker leading a group: its members' heartbeats and its own in one file."""
        group = self.leads()
        if group is None or self.heartbeat is None or self.heartbeat.last is None:
            return
        beats = {r: fsio.read_record(self.attempt.heartbeat(r)) for r in self.fan_in.ranks(group) if r != self.rank}
        self._relayed += 1
        fsio.write_record(self.attempt.group_heartbeat(group), {
            "leader": self.rank, "pid": os.getpid(), "counter": self._relayed,
            "beats": {**{str(r): b for r, b in beats.items() if b is not None}, str(self.rank): self.heartbeat.last},
        }, durable=False)

    def _watch_master(self, now: float) -> tuple[Culprit | None, dict | None]:
        """Worker: one read of the master's heartbeat (unless a barrier wait just read it);
        ``abort.json`` only when the master says it aborted, ended, or looks dead."""
        beat = self.word.read(max_age_s=self.poll_s)
        with self._lock:
            self.tracker.observe(0, beat, now)
            abort = None
            if beat is None or beat.get("abort") or beat.get("state") in TERMINAL_STATES or self.tracker.dead(now):
                fsio.refresh_dir(self.attempt.root)
                abort = fsio.read_record(self.attempt.abort)
            return worker_verdict(abort, self.tracker, now, self.hosts), beat

    def _members_now(self, beat: dict | None) -> Members:
        """Worker, elastic: the master's membership record, read again only when the master's
        heartbeat says it rewrote it."""
        version = beat.get("members") if beat is not None else self._members_version
        if self._members is None or version != self._members_version:
            self._members, self._members_version = Members.read(self.attempt.members), version
        return self._members

    def members_seen(self) -> Members | None:
        """Worker, elastic: the master's membership record as this monitor last read it."""
        return self._members

    def _failures(self) -> dict[int, dict]:
        """Master: the failure records of the ranks in the run: those the failures directory
        lists, and those whose heartbeat says they ended (a listing can lag on FUSE)."""
        try:
            listed = {int(e.name[1:-5]) for e in os.scandir(self.attempt.failures)
                      if e.name.startswith("r") and e.name.endswith(".json") and e.name[1:-5].isdigit()}
        except FileNotFoundError:
            listed = set()
        ended = {r for r in self.tracker.watched() if (self.tracker.last(r) or {}).get("state") in TERMINAL_STATES}
        failures = {}
        for r in sorted((listed | ended) - self.out - {self.rank}):
            f = fsio.read_record(self.attempt.failure(r))
            if f is not None:
                failures[r] = f
        return failures

    def _verdict(self, now: float) -> Culprit | None:
        """Master: the root cause that ends the attempt, if any."""
        with self._lock:
            if self.stop_requested is None:
                fsio.refresh_dir(self.attempt.root)
                self.stop_requested = fsio.read_record(self.attempt.stop)
            culprit = master_verdict(self._failures(), self.tracker, now, self.hosts)
        if culprit is not None and culprit.kind is FailureKind.DEAD and culprit.rank != self.rank \
                and self.on_silent is not None and self.on_silent(culprit):
            return None  # the run goes on without it
        return culprit

    def _overran(self, deadline: Deadline) -> None:
        iteration, phase = self.where()
        culprit = Culprit(self.rank, self.host, iteration, phase.label if phase is not None else None, FailureKind.DEADLINE,
                          f"the phase's work ran past {deadline.what}")
        log.error("%s", culprit.describe())
        if self.is_master:
            publish_abort(self.attempt, culprit, self.heartbeat)
        if self.cancel.cancel(DeadlineExceeded(culprit.error)):
            self.on_cancel()

    def _end_attempt(self, culprit: Culprit) -> None:
        if self.is_master:
            publish_abort(self.attempt, culprit, self.heartbeat)
        log.error("stopping: %s", culprit.describe())
        if self.cancel.cancel(PeerFailed(culprit)):
            self.on_cancel()


_abort_lock = threading.Lock()


def publish_abort(attempt: AttemptLayout, culprit: Culprit, heartbeat=None) -> None:
    """The master's one word on why this attempt ended; the first cause wins (the monitor
    and the main thread may both try, hence the lock). ``heartbeat``: the master's, which
    then says ``abort`` to the workers watching it."""
    with _abort_lock:
        if fsio.read_record(attempt.abort) is None:
            fsio.write_record(attempt.abort, {"culprit": records.to_dict(culprit), "at": time.time()})
    if heartbeat is not None:
        heartbeat.update(abort=True)
