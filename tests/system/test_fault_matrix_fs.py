"""The fault matrix, filesystem part (issue 6): real `orchestrator run --rehearsal` ranks, each
on its own faultfs mount of one backing directory (tests/faultfs.py), with faults injected
into their view of the shared filesystem.

Every case checks that (a) no rank outlives its deadline (every wait is bounded, by far
more than the node timeout, and a failure is detected within node timeout + 5 s of the
fault), (b) a failed run names the rank, iteration, phase and cause, in the ranks' output
and in `orchestrator status`, and (c) re-running the same commands with the faults cleared
completes the run with every planned task aggregated exactly once. Detection times (fault
to the last rank's exit) are printed (``pytest -s`` or ``-rP`` shows them) and recorded as
junit properties.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import psutil
import pytest

from tests.faultfs import FaultMount
from tests.harness import (
    NODE_TIMEOUT_S,
    Cluster,
    RankProc,
    aggregate_task_ids,
    run_flags,
    status_json,
    wait_mid_rollout,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

N = 3
RUN_TIMEOUT_S = 60.0  # a whole one-iteration run, faults included: 20x the node timeout
DETECT_BOUND_S = NODE_TIMEOUT_S + 5.0  # fault -> every rank has exited, when a run fails
SYNC_FILES = ["run/attempts/*/arrivals/*", "run/attempts/*/release.json", "run/attempts/*/heartbeats/*"]
SHARDS = "run/iterations/*/rollout/*/*.jsonl"


@dataclass
class Outcome:
    procs: list[RankProc]
    codes: dict[int, int]
    exited_at: dict[int, float]  # wall time
    started_at: float
    children: set[int] = field(default_factory=set)

    @property
    def last_exit(self) -> float:
        return max(self.exited_at.values())

    @property
    def elapsed(self) -> float:
        return self.last_exit - self.started_at

    def output(self, rank: int) -> str:
        return self.procs[rank].output()

    def all_output(self) -> str:
        return "\n".join(f"--- rank {p.rank} (exit {self.codes.get(p.rank)}) ---\n{p.output()}" for p in self.procs)


class FsCluster:
    """N ranks, rank R working through mount R; ranks are killed before mounts are torn down."""

    def __init__(self, cluster: Cluster, mounts: list[FaultMount], extra: list[str]):
        self.cluster = cluster
        self.mounts = mounts
        self.extra = extra
        self.run_dir = mounts[0].backing / "run"

    def flags(self, rank: int) -> list[str]:
        return run_flags(self.mounts[rank].path / "run", max_iterations=1, extra=self.extra)

    def run(self, timeout: float = RUN_TIMEOUT_S, during=None) -> Outcome:
        """Start every rank, call ``during()`` (may set faults), and wait for all to exit."""
        procs = [self.cluster.start(r, self.flags(r)) for r in range(N)]
        started = time.time()
        if during is not None:
            during()
        codes, exited, children = {}, {}, set()
        deadline = time.monotonic() + timeout
        next_scan = 0.0
        while len(codes) < N:
            for p in procs:
                if p.rank not in codes and p.proc.poll() is not None:
                    codes[p.rank], exited[p.rank] = p.proc.returncode, time.time()
            if time.monotonic() >= next_scan:  # the ranks' children (the rehearsal engine)
                for p in procs:
                    if p.rank not in codes:
                        children.update(_descendants(p.pid))
                next_scan = time.monotonic() + 0.1
            if time.monotonic() > deadline:
                alive = [p.rank for p in procs if p.rank not in codes]
                outputs = "\n".join(f"--- rank {p.rank} ---\n{p.output()[-3000:]}" for p in procs)
                self.cluster.kill_all()
                pytest.fail(f"ranks {alive} outlived their deadline ({timeout:g} s)\n{outputs}")
            time.sleep(0.01)
        outcome = Outcome(procs, codes, exited, started, children)
        left = [pid for pid in children if _alive(pid)]
        assert not left, f"children of the ranks outlived them: {left}\n{outcome.all_output()}"
        return outcome

    def clear_faults(self) -> None:
        for m in self.mounts:
            m.clear_faults()

    def rerun_completes(self) -> Outcome:
        """(c): the same commands, no faults: the run completes, every task counted once."""
        self.clear_faults()
        again = self.run()
        assert list(again.codes.values()) == [0] * N, again.all_output()
        status = status_json(self.run_dir)
        assert status["failure"] is None, status["failure"]
        assert all(r["state"] == "done" for r in status["ranks"]), status["ranks"]
        assert_exact_accounting(self.run_dir)
        return again


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def assert_exact_accounting(run_dir) -> None:
    from orchestrator.protocol.layout import RunLayout

    ids = aggregate_task_ids(RunLayout(run_dir), 1)
    assert sorted(ids) == [f"train-000001-{k:06d}" for k in range(12)], "tasks missing or counted twice"


def assert_failure_named(outcome: Outcome, run_dir, *, rank: int, iteration: int, phase: str, cause: str) -> None:
    """(b): the failing rank says what failed where; every other rank names it; so does status."""
    where = f"at iteration {iteration}, phase {phase}"
    mine = outcome.output(rank)
    assert re.search(rf"rank {rank} failed {re.escape(where)}: .*{cause}", mine), mine
    for r in range(N):
        if r != rank:
            out = outcome.output(r)
            assert re.search(rf"rank {rank} on host \S+ failed {re.escape(where)}: .*{cause}", out), out
    failure = status_json(run_dir)["failure"]
    assert (failure["rank"], failure["iteration"], failure["phase"]) == (rank, iteration, phase), failure
    assert re.search(cause, failure["error"]), failure


def report_detection(record_property, case: str, fault_at: float, outcome: Outcome) -> float:
    detect = outcome.last_exit - fault_at
    first = min(outcome.exited_at.values()) - fault_at
    print(f"\n[fault-matrix] {case}: exits {outcome.codes}; first exit {first:.2f} s, "
          f"last exit {detect:.2f} s after the fault (node timeout {NODE_TIMEOUT_S:g} s)")
    record_property(f"detection_s[{case}]", round(detect, 3))
    assert detect < DETECT_BOUND_S, f"{case}: the last rank exited {detect:.1f} s after the fault"
    return detect


def event_at(mount: FaultMount, kind: str, path_re: str) -> float:
    """Wall time of the first ``kind`` injection on a path matching ``path_re``."""
    stats = mount.wait_stats(lambda s: any(e[1] == kind and re.search(path_re, e[2]) for e in s.get("events", [])),
                             what=f"a {kind} on {path_re}")
    return min(e[0] for e in stats["events"] if e[1] == kind and re.search(path_re, e[2]))


@pytest.fixture
def fs_cluster(faultfs_mounts, tmp_path):
    """``make(per_mount, extra=[])``: three mounts with these faults and a Cluster on them."""
    clusters: list[Cluster] = []

    def make(per_mount: list, extra: list[str] = ()) -> FsCluster:
        backing, mounts = faultfs_mounts(N, per_mount=per_mount)
        logs = tmp_path / "rank-logs"
        logs.mkdir(exist_ok=True)
        cluster = Cluster(tmp=logs, log_path=backing / "run")
        clusters.append(cluster)
        return FsCluster(cluster, mounts, list(extra))

    yield make
    for c in clusters:  # before faultfs_mounts unmounts: no rank may keep a mount busy
        c.kill_all()
        for p in c.procs:
            try:
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass


# -- visibility ------------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [0.5, 1.0], ids=["half-node-timeout", "node-timeout"])
def test_delayed_visibility_of_sync_files_slows_the_run_but_it_completes(fs_cluster, factor, record_property):
    """New files under attempts/ and control/ (lease, joins, heartbeats, arrivals, release,
    start, failures) stay invisible to the other mounts for `factor` x node timeout. Ranks
    poll known names, and a name once seen stays visible when it is replaced, so every
    barrier waits at most one delay for a name it has never seen: the run completes."""
    delay = factor * NODE_TIMEOUT_S
    rules = [{"glob": "run/attempts/**", "delay_new_s": delay}, {"glob": "run/control/**", "delay_new_s": delay}]
    c = fs_cluster([rules] * N)
    outcome = c.run()
    assert list(outcome.codes.values()) == [0] * N, outcome.all_output()
    assert all(m.count("hidden") > 0 for m in c.mounts)
    assert outcome.elapsed > delay  # the delay did hold the run up
    assert_exact_accounting(c.run_dir)
    print(f"\n[fault-matrix] visibility delay {delay:g} s on sync files: completed in {outcome.elapsed:.1f} s")
    record_property(f"run_s[delay {delay:g}]", round(outcome.elapsed, 3))


def test_delayed_visibility_of_work_products_completes(fs_cluster, record_property):
    """Every new file, work products included, is invisible to other mounts for half the
    node timeout. docs/shared-filesystems.md: a peer's new file can look absent for up to a minute; the master
    waits for a rank's new seal up to one node timeout, so the run completes (slower)."""
    delay = 0.5 * NODE_TIMEOUT_S
    c = fs_cluster([{"glob": "run/**", "delay_new_s": delay}] * N)
    outcome = c.run()
    assert list(outcome.codes.values()) == [0] * N, outcome.all_output()
    assert_exact_accounting(c.run_dir)
    print(f"\n[fault-matrix] every new file hidden {delay:g} s: completed in {outcome.elapsed:.1f} s")
    record_property("run_s[delay work products]", round(outcome.elapsed, 3))


# -- ESTALE and truncated reads ----------------------------------------------------------------

def test_estale_on_barrier_and_heartbeat_files_is_absorbed(fs_cluster, record_property):
    """Half the opens of arrivals, release.json and heartbeats fail with ESTALE on every
    mount (a quarter reach the process: the kernel retries once). fsio reads them as "not
    there yet" and polls again: the run completes."""
    c = fs_cluster([[{"glob": g, "estale": {"probability": 0.5, "seed": 10 * r + i}} for i, g in enumerate(SYNC_FILES)]
                    for r in range(N)])
    outcome = c.run()
    assert list(outcome.codes.values()) == [0] * N, outcome.all_output()
    counts = [m.count("estale") for m in c.mounts]
    assert all(n >= 2 for n in counts), counts
    assert_exact_accounting(c.run_dir)
    print(f"\n[fault-matrix] ESTALE on sync files: {counts} injected, completed in {outcome.elapsed:.1f} s")
    record_property("run_s[estale sync]", round(outcome.elapsed, 3))


def test_truncated_reads_of_barrier_and_heartbeat_files_are_absorbed(fs_cluster, record_property):
    """The first read of each new version of arrivals, release.json and heartbeats returns
    half the file (at most 20 per kind and mount): the checksum envelope rejects it, the next
    poll reads it whole, and the run completes."""
    c = fs_cluster([[{"glob": g, "truncate_once": {"reads": 1, "count": 20}} for g in SYNC_FILES]] * N)
    outcome = c.run()
    assert list(outcome.codes.values()) == [0] * N, outcome.all_output()
    counts = [m.count("truncated") for m in c.mounts]
    assert all(n >= 2 for n in counts), counts
    assert_exact_accounting(c.run_dir)
    print(f"\n[fault-matrix] truncated reads of sync files: {counts} injected, completed in {outcome.elapsed:.1f} s")
    record_property("run_s[truncated sync]", round(outcome.elapsed, 3))


def test_estale_on_a_rank_reading_its_shard_is_retried(fs_cluster, record_property):
    """Rank 1's read of its own shard when sealing it fails with ESTALE (twice: past the
    kernel's retry). Sealing tries again after a pause: the run completes."""
    c = fs_cluster([None, {"glob": SHARDS, "estale": {"count": 2}}, None])
    outcome = c.run()
    assert list(outcome.codes.values()) == [0] * N, outcome.all_output()
    assert c.mounts[1].count("estale") >= 2
    assert "trying again" in outcome.output(1)
    assert_exact_accounting(c.run_dir)
    record_property("run_s[estale shard]", round(outcome.elapsed, 3))


def test_a_persistent_estale_on_a_shard_fails_naming_the_file(fs_cluster, record_property):
    """ESTALE on every read of rank 1's shard: after its retries the rank fails naming the
    file, the others stop naming it, and a re-run without the fault completes."""
    c = fs_cluster([None, {"glob": SHARDS, "estale": {"count": 1000}}, None])
    outcome = c.run()
    assert outcome.codes == {0: 3, 1: 1, 2: 3}, outcome.all_output()
    assert_failure_named(outcome, c.run_dir, rank=1, iteration=1, phase="2:rollout_done",
                         cause=r"OSError: \[Errno 116\] Stale file handle: '\S+/iterations/000001/rollout/train/r00001\.jsonl'")
    report_detection(record_property, "persistent ESTALE on a shard", event_at(c.mounts[1], "estale", r"r00001\.jsonl$"), outcome)
    c.rerun_completes()


def test_a_truncated_read_of_a_shard_by_the_master_is_retried(fs_cluster, record_property):
    """The master's first read of rank 1's and rank 2's shards (merging, phase 4) returns half
    the file: the checksum fails, the merge reads them again, and the run completes."""
    c = fs_cluster([{"glob": "run/iterations/*/rollout/*/r0000[12].jsonl", "truncate_once": True}, None, None])
    outcome = c.run()
    assert list(outcome.codes.values()) == [0] * N, outcome.all_output()
    assert c.mounts[0].count("truncated") >= 1
    assert "trying again" in outcome.output(0)
    assert_exact_accounting(c.run_dir)
    record_property("run_s[truncated shard]", round(outcome.elapsed, 3))


# -- ENOSPC ------------------------------------------------------------------------------------

def test_shard_quota_exhausted_fails_naming_enospc_then_rerun_completes(fs_cluster, record_property):
    """Rank 1's shard may take 500 bytes (about one record): its rollout fails with ENOSPC,
    its failure record (other files still have room) tells the master, who stops everyone
    naming rank 1, iteration 1, rollout and ENOSPC. Lifted, a re-run completes. No work
    stealing: a rank slow to start would find its chunks taken, write no rollout shard, and
    fail later, in eval."""
    c = fs_cluster([None, {"glob": SHARDS, "enospc_after_bytes": 500}, None], extra=["coordination.work_stealing=false"])
    outcome = c.run()
    assert outcome.codes == {0: 3, 1: 1, 2: 3}, outcome.all_output()
    assert_failure_named(outcome, c.run_dir, rank=1, iteration=1, phase="1:rollout",
                         cause=r"OSError: \[Errno 28\] No space left on device")
    report_detection(record_property, "ENOSPC on a shard (quota)", event_at(c.mounts[1], "enospc", r"r00001\.jsonl$"), outcome)
    c.rerun_completes()


def test_disk_full_mid_rollout_fails_and_rerun_completes_once_freed(fs_cluster, record_property):
    """Rank 1's whole view of the filesystem fills up while it writes its shard: the rollout
    fails with ENOSPC, and so do its failure record and heartbeat (the disk is full), so the
    others learn of it only when its heartbeat stops: one node timeout. Rank 1 names ENOSPC,
    iteration and phase itself; the others name rank 1, iteration and phase. Freed, a re-run
    completes."""
    c = fs_cluster([None, None, None], extra=["rehearsal.work_s=1"])
    fault = {}

    def fill_mid_rollout():
        from orchestrator.protocol.layout import RunLayout

        wait_mid_rollout(RunLayout(c.run_dir), 1, timeout=30)
        c.mounts[1].set_faults({"glob": "run/**", "enospc_after_bytes": 0})
        fault["set"] = time.time()

    outcome = c.run(during=fill_mid_rollout)
    assert outcome.codes == {0: 3, 1: 1, 2: 3}, outcome.all_output()
    mine = outcome.output(1)
    assert re.search(r"rank 1 failed at iteration 1, phase 1:rollout: OSError: \[Errno 28\] No space left on device", mine), mine
    assert "could not write the failure record: [Errno 28] No space left on device" in mine, mine
    for r in (0, 2):
        out = outcome.output(r)
        assert re.search(r"rank 1 on host \S+ died \(heartbeat stopped\) at iteration 1, phase 1:rollout", out), out
    failure = status_json(c.run_dir)["failure"]
    assert (failure["rank"], failure["iteration"], failure["phase"], failure["kind"]) == (1, 1, "1:rollout", "dead"), failure
    fault_at = event_at(c.mounts[1], "enospc", r"^run/")
    assert fault_at >= fault["set"] - 0.01
    detect = report_detection(record_property, "disk full mid-rollout", fault_at, outcome)
    assert detect > NODE_TIMEOUT_S - 0.5  # the peers had to wait for the heartbeat to go quiet
    c.rerun_completes()
