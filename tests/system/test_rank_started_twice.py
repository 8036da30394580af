"""The same rank of a run started twice on one host: the second process exits 2 at once, long
before any join or lease timeout, names the rank, the host and the pid that runs it, and writes
nothing to the run. A rank killed with kill -9 leaves no lock behind: the same command starts
it again at once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.node import identity
from orchestrator.protocol import fsio
from tests.harness import current_attempt, kill_tree, run_flags, wait_for

pytestmark = pytest.mark.timeout(120)

# Waits of ten minutes, so that a refusal within seconds comes from the lock and not from a
# timeout; and a heartbeat so slow that the waiting ranks rewrite nothing while the test looks.
SLOW = ["coordination.node_timeout_s=600", "coordination.join_timeout_s=600", "coordination.heartbeat_interval_s=120"]
REFUSED_WITHIN_S = 15.0  # a process start (about 1 s here), with room for a loaded machine


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root`` with its size and mtime: a directory's mtime
    moves with any file created, renamed or removed in it, a temporary one included."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in [root, *root.rglob("*")]}


def _start_alone(cluster, rank: int, flags: list[str]):
    """``rank`` without the others, once it waits for them (before a master comes, a worker
    writes nothing to the run)."""
    first = cluster.start(rank, flags)
    waits = "waiting for ranks " if rank == 0 else "waiting for the master (rank 0) to start an attempt"

    def waiting():
        assert first.proc.poll() is None, first.output()
        return waits in first.output()

    wait_for(waiting, 60, f"rank {rank} to wait for the others")
    return first


def _start_waiting_for_rank_2(cluster, flags):
    """The master and worker 1 of a 3-rank run, waiting for rank 2 (which never comes) once
    rank 1 has joined the master's attempt."""
    first = [cluster.start(0, flags), cluster.start(1, flags)]
    layout = cluster.layout

    def joined():
        assert all(p.proc.poll() is None for p in first), "\n".join(p.output() for p in first)
        attempt = current_attempt(layout)
        return attempt and fsio.read_record(layout.attempt(attempt).join(1))

    wait_for(joined, 60, "rank 1 to join the master's attempt")
    return first


def _refused(cluster, rank: int, flags: list[str], env: dict | None = None):
    """Start ``rank`` again; return its output once it has exited 2 within REFUSED_WITHIN_S."""
    started = time.monotonic()
    second = cluster.start(rank, flags, env)
    code = second.wait(timeout=REFUSED_WITHIN_S)
    took = time.monotonic() - started
    assert code == 2, second.output()
    assert took < REFUSED_WITHIN_S, f"refused after {took:.1f} s"
    return " ".join(second.output().split())


@pytest.mark.parametrize("rank", [0, 1], ids=["master", "worker"])
def test_the_same_rank_started_twice_on_one_host_exits_2_at_once_and_writes_nothing(cluster, rank):
    """Alone, before the others start: the second worker would otherwise wait for a master
    as long as the first (the join timeout), the second master read the lease."""
    flags = run_flags(cluster.log_path, max_iterations=1, extra=SLOW)
    first = _start_alone(cluster, rank, flags)
    cluster.log_path.mkdir(exist_ok=True)  # a worker alone has not written even that
    before = _files(cluster.log_path)

    out = _refused(cluster, rank, flags)
    assert (f"rank {rank} of --log-path {cluster.log_path} is already running on host {identity.host()} "
            f"(pid {first.pid})") in out, out
    assert "stop it first" in out.lower() and "--worker R" in out, out
    assert _files(cluster.log_path) == before, "the refused process wrote to the run"
    assert first.proc.poll() is None, "the first process goes on"


def test_the_same_ranks_started_twice_while_they_run_are_refused_and_the_run_goes_on(cluster):
    flags = run_flags(cluster.log_path, max_iterations=1, extra=SLOW)
    first = _start_waiting_for_rank_2(cluster, flags)
    before = _files(cluster.log_path)
    for rank in (0, 1):
        out = _refused(cluster, rank, flags)
        assert (f"rank {rank} of --log-path {cluster.log_path} is already running on host {identity.host()} "
                f"(pid {first[rank].pid})") in out, out
    assert _files(cluster.log_path) == before, "a refused process wrote to the run"
    third = cluster.start(2, flags)
    assert cluster.wait_all([*first, third], timeout=90) == [0, 0, 0], "\n".join(p.output() for p in [*first, third])


def test_a_rank_the_lock_cannot_see_is_refused_when_it_joins_the_attempt(cluster, tmp_path):
    """Another TMPDIR is another lock directory: the worker's join-record check refuses it
    instead, as soon as it reads the attempt (same host only, as the lock)."""
    flags = run_flags(cluster.log_path, max_iterations=1, extra=SLOW)
    first = _start_waiting_for_rank_2(cluster, flags)
    before = _files(cluster.log_path)
    other_tmp = tmp_path / "other-tmp"
    other_tmp.mkdir()

    out = _refused(cluster, 1, flags, env={"TMPDIR": str(other_tmp)})
    assert f"rank 1 is already running on host {identity.host()} (pid {first[1].pid})" in out, out
    assert _files(cluster.log_path) == before, "the refused process wrote to the run"


@pytest.mark.parametrize("rank", [0, 1], ids=["master", "worker"])
def test_a_rank_killed_with_kill_9_starts_again_at_once(cluster, rank):
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", max_iterations=1)
    first = _start_alone(cluster, rank, flags)
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(timeout=10) == -signal.SIGKILL

    again = cluster.start(rank, flags)
    other = cluster.start(1 - rank, flags)
    assert cluster.wait_all([again, other], timeout=90) == [0, 0], again.output() + other.output()
    assert "already running" not in again.output()


def test_a_doctor_started_twice_for_one_rank_exits_2_at_once_beside_a_running_rank(cluster):
    """`doctor` holds its own lock: it may run beside the rank (a run that hangs at its first
    collective), but not twice for one rank."""
    rank = _start_alone(cluster, 0, run_flags(cluster.log_path, max_iterations=1, extra=SLOW))  # the master, as the doctors
    doctor = [sys.executable, "-m", "orchestrator", "doctor", f"--log-path={cluster.log_path}", "--num-nodes=3", "--master",
              "--timeout=60"]
    first = subprocess.Popen(doctor, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: fsio.read_record(cluster.layout.doctor_session), 30, "the first doctor's session")
        started = time.monotonic()
        second = subprocess.run(doctor, capture_output=True, text=True, timeout=REFUSED_WITHIN_S)
        assert second.returncode == 2 and time.monotonic() - started < REFUSED_WITHIN_S, second.stderr
        assert f"doctor for rank 0 of --log-path {cluster.log_path} is already running on host {identity.host()} " \
               f"(pid {first.pid})" in " ".join(second.stderr.split())
        assert first.poll() is None and rank.proc.poll() is None
    finally:
        kill_tree(first.pid)
        first.wait(timeout=10)
