"""The watcher thread of a rank: it notices a failed, dead or stopped peer while the main
thread is busy, and cancels the rank at once.

Cost per poll is O(1) on a worker (the master's heartbeat and the attempt's abort file) and
O(N) on the master (each rank's failure file, and heartbeats once per heartbeat interval):
O(N) in all, never every rank reading every rank. The master turns what it sees into one
``abort.json`` naming the root cause, which every worker polls.

Deciding is separate from doing: :func:`master_verdict` and :func:`worker_verdict` are pure
functions of what was read; :class:`Monitor` does the reading, writing and cancelling.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from orchestrator import records
from orchestrator.errors import ROOT_CAUSE_KINDS, Culprit, DeadlineExceeded, FailureKind, OrchestratorError, PeerFailed
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import AttemptLayout
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.membership import ranks_text
from orchestrator.protocol.schema import Members
from orchestrator.protocol.waiting import CancelToken, Deadline

log = logging.getLogger(__name__)


def poll_interval_s(heartbeat_interval_s: float) -> float:
    """How often a monitor looks for a verdict (and heartbeats are read every half interval)."""
    return min(0.25, heartbeat_interval_s / 2)


def verdict_bound_s(node_timeout_s: float, heartbeat_interval_s: float) -> float:
    """The longest, from a rank's death, until every other rank's monitor knows of it. Its
    last beat was written up to one heartbeat interval before it died (a full interval, not
    the half at which the master reads them: that half covers a beat seen late); the master
    calls it dead ``node_timeout_s`` after the last change it saw, at its next poll, and a
    worker reads the master's abort at its own next poll. A rank that sees the death first
    (a trainer's lost connection) waits this long for the verdict naming the rank that died."""
    return node_timeout_s + heartbeat_interval_s + 2 * poll_interval_s(heartbeat_interval_s)


def culprit_from_failure(rank: int, failure: dict) -> Culprit:
    return Culprit(
        rank=rank,
        host=failure.get("host", "?"),
        iteration=failure.get("iteration"),
        phase=failure.get("phase"),
        kind=failure.get("kind", "error"),
        error=failure.get("error", "unknown error"),
    )


def culprit_dead(rank: int, tracker: LivenessTracker, now: float, hosts: dict[int, str]) -> Culprit:
    last = tracker.last(rank) or {}
    return Culprit(
        rank=rank,
        host=last.get("host") or hosts.get(rank, "?"),
        iteration=last.get("iteration"),
        phase=last.get("phase"),
        kind=FailureKind.DEAD,
        error=f"no heartbeat for {tracker.silent_for(rank, now):.1f} s (node timeout {tracker.timeout_s:g} s)",
    )


def master_verdict(
    failures: dict[int, dict], tracker: LivenessTracker, now: float, hosts: dict[int, str]
) -> Culprit | None:
    """The root cause that ends the attempt, if any: a rank's own failure record first
    (it knows why); then workers that gave up on the master (it was frozen or paused past
    the node timeout: they judged it dead and left, so nothing is left to wait for); else
    the first rank whose heartbeat stopped."""
    for rank in sorted(failures):
        f = failures[rank]
        if f.get("kind") in ROOT_CAUSE_KINDS:
            return culprit_from_failure(rank, f)
    left = abandoned_by(failures)
    if left:
        seen = failures[left[0]]["culprit"]
        return Culprit(0, seen.get("host") or hosts.get(0, "?"), seen.get("iteration"), seen.get("phase"), FailureKind.DEAD,
                       f"its heartbeat stood still past the node timeout (the master was frozen or paused) and rank(s) "
                       f"{ranks_text(left)} gave up on it")
    dead = tracker.dead(now)
    if dead:
        return culprit_dead(dead[0], tracker, now, hosts)
    return None


def abandoned_by(failures: dict[int, dict]) -> list[int]:
    """The workers whose failure record says they left because the master looked dead."""
    def gave_up(f: dict) -> bool:
        culprit = f.get("culprit") or {}
        return f.get("kind") == FailureKind.PEER and culprit.get("rank") == 0 and culprit.get("kind") == FailureKind.DEAD
    return sorted(r for r, f in failures.items() if r != 0 and gave_up(f))


def worker_verdict(abort: dict | None, tracker: LivenessTracker, now: float, hosts: dict[int, str]) -> Culprit | None:
    if abort is not None:
        return records.from_dict(abort["culprit"], Culprit)
    if tracker.dead(now):
        return culprit_dead(0, tracker, now, hosts)
    return None


class Monitor:
    """Runs the verdict for this rank's role every poll and cancels the rank on one."""

    def __init__(
        self,
        *,
        attempt: AttemptLayout,
        rank: int,
        num_nodes: int,
        cancel: CancelToken,
        heartbeat_interval_s: float,
        node_timeout_s: float,
        poll_s: float,
        hosts: dict[int, str],
        on_cancel: Callable[[], None],
    ):
        self.attempt = attempt
        self.rank = rank
        self.num_nodes = num_nodes
        self.cancel = cancel
        self.hb_every = heartbeat_interval_s / 2
        self.poll_s = poll_s
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
        self.on_members: Callable[[Members], OrchestratorError | None] | None = None
        """Worker, elastic: judges the master's membership record each poll; what it returns
        (the run went on without this process, or the training step is redone) cancels the rank."""
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
        next_hb = 0.0
        while not self._halt.is_set() and self.cancel.reason is None:
            now = time.monotonic()
            try:
                if now >= next_hb:
                    self._read_heartbeats(now)
                    next_hb = now + self.hb_every
                verdict = self._verdict(now)
            except OSError as e:
                log.warning("monitor could not read the shared filesystem: %s", e)
                verdict = None
            if verdict is not None:
                self._end_attempt(verdict)
                return
            try:
                news = self.on_members(Members.read(self.attempt.members)) if self.on_members is not None else None
            except OSError:
                news = None
            if news is not None:
                log.error("%s", news)
                if self.cancel.cancel(news):
                    self.on_cancel()
                return
            deadline = self.work_deadline
            if deadline is not None and deadline.expired():
                self._overran(deadline)
                return
            self._halt.wait(self.poll_s)

    def _read_heartbeats(self, now: float) -> None:
        fsio.refresh_dir(self.attempt.heartbeats)
        with self._lock:
            ranks = self.tracker.watched() if self.is_master else [0]
            for r in ranks:
                self.tracker.observe(r, fsio.read_record(self.attempt.heartbeat(r)), now)

    def _verdict(self, now: float) -> Culprit | None:
        with self._lock:
            fsio.refresh_dir(self.attempt.root)
            if self.is_master:
                if self.stop_requested is None:
                    self.stop_requested = fsio.read_record(self.attempt.stop)
                fsio.refresh_dir(self.attempt.failures)
                failures = {}
                for r in range(1, self.num_nodes):
                    f = fsio.read_record(self.attempt.failure(r)) if r not in self.out else None
                    if f is not None:
                        failures[r] = f
                culprit = master_verdict(failures, self.tracker, now, self.hosts)
            else:
                culprit = worker_verdict(fsio.read_record(self.attempt.abort), self.tracker, now, self.hosts)
        if culprit is not None and self.is_master and culprit.kind is FailureKind.DEAD and culprit.rank != self.rank \
                and self.on_silent is not None and self.on_silent(culprit):
            return None  # the run goes on without it
        return culprit

    def _overran(self, deadline: Deadline) -> None:
        iteration, phase = self.where()
        culprit = Culprit(self.rank, self.host, iteration, phase.label if phase is not None else None, FailureKind.DEADLINE,
                          f"the phase's work ran past {deadline.what}")
        log.error("%s", culprit.describe())
        if self.is_master:
            publish_abort(self.attempt, culprit)
        if self.cancel.cancel(DeadlineExceeded(culprit.error)):
            self.on_cancel()

    def _end_attempt(self, culprit: Culprit) -> None:
        if self.is_master:
            publish_abort(self.attempt, culprit)
        log.error("stopping: %s", culprit.describe())
        if self.cancel.cancel(PeerFailed(culprit)):
            self.on_cancel()


_abort_lock = threading.Lock()


def publish_abort(attempt: AttemptLayout, culprit: Culprit) -> None:
    """The master's one word on why this attempt ended; the first cause wins (the monitor
    and the main thread may both try, hence the lock)."""
    with _abort_lock:
        if fsio.read_record(attempt.abort) is None:
            fsio.write_record(attempt.abort, {"culprit": records.to_dict(culprit), "at": time.time()})
