"""Ctrl+C and SIGTERM stop a rank's whole process tree; `stop` ends a run gracefully
(issue 2, done-when 8)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from orchestrator.cli.local import cores
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from tests.harness import (
    aggregate_task_ids,
    descendants,
    kill_tree,
    run_flags,
    status_json,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.timeout(120)


def _gone(pids) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("victim", [0, 1], ids=["master", "worker"])
def test_signal_stops_the_rank_tree_and_others_say_it_was_stopped_by_the_user(cluster, victim, sig):
    flags = run_flags(cluster.log_path, max_iterations=1)
    procs = cluster.start_all(flags, env_for={victim: {"ORCHESTRATOR_FAULT": f"hold@1:{int(Phase.ROLLOUT)}"}})
    wait_state(cluster.layout, victim, "held")
    tree = descendants(procs[victim].pid)
    assert tree, "the rank runs an engine child during rollout"
    os.kill(procs[victim].pid, sig)
    sent = time.monotonic()
    assert procs[victim].wait(timeout=10) == 130, procs[victim].output()
    wait_for(lambda: _gone(tree), 10 - (time.monotonic() - sent), "the rank's children to exit")

    survivors = [p for p in procs if p.rank != victim]
    assert cluster.wait_all(survivors, timeout=10) == [3, 3]
    for p in survivors:
        out = p.output()
        assert f"rank {victim} on host" in out and f"was stopped by the user ({sig.name})" in out, out
        assert "died" not in out
    assert status_json(cluster.log_path)["failure"]["kind"] == "interrupted"


def test_ctrl_c_on_local_reaches_every_rank_and_leaves_nothing_running(tmp_path):
    log_path = tmp_path / "run"
    flags = run_flags(log_path, max_iterations=None, extra=["rehearsal.work_s=1"])
    flags = [f for f in flags if not f.startswith("--rank-weights")]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    launcher = subprocess.Popen([sys.executable, "-m", "orchestrator", "local", *flags],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        tree = wait_for(lambda: (lambda d: d if len(d) >= 6 else None)(descendants(launcher.pid)), 30,
                        "three ranks and their engines to run")
        # Three ranks share this machine's cores: each rank and its children get an equal share.
        threads = str(max(1, cores() // 3))
        ranks = psutil.Process(launcher.pid).children()
        assert len(ranks) == 3 and all(r.environ().get("OMP_NUM_THREADS") == threads for r in ranks), threads
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=15)
        assert launcher.returncode == 130, out.decode()
        wait_for(lambda: _gone(tree), 5, "every rank and engine to exit")
        text = out.decode()
        for r in range(3):
            assert f"[rank {r}]" in text
        assert "rank 0: 130, rank 1: 130, rank 2: 130" in text
        assert f"[local] 3 ranks share this machine's cores: OMP_NUM_THREADS={threads} in each" in text
    finally:
        kill_tree(launcher.pid)


def test_stop_ends_every_rank_at_the_next_boundary_and_a_rerun_continues(cluster):
    flags = run_flags(cluster.log_path, max_iterations=3, extra=["rehearsal.work_s=0.5"])
    procs = cluster.start_all(flags)
    wait_for(lambda: fsio.read_record(cluster.layout.progress), 30, "the first barrier release")
    stop = subprocess.run([sys.executable, "-m", "orchestrator", "stop", f"--log-path={cluster.log_path}"],
                          capture_output=True, text=True, timeout=30)
    assert stop.returncode == 0, stop.stderr
    assert cluster.wait_all(procs, timeout=30) == [0, 0, 0]
    for p in procs:
        assert "stopped on request" in p.output()
    stopped_at = fsio.read_record(cluster.layout.progress)
    assert (stopped_at["iteration"], stopped_at["phase"]) < (3, int(Phase.SYNC_END))

    again = cluster.start_all(flags)
    assert cluster.wait_all(again, timeout=60) == [0, 0, 0], "\n".join(p.output() for p in again)
    for i in (1, 2, 3):
        assert len(set(aggregate_task_ids(cluster.layout, i))) == 12
    assert [it["complete"] for it in status_json(cluster.log_path)["iterations"]] == [True, True, True]


def test_stop_without_a_live_run_says_so(tmp_path):
    result = subprocess.run([sys.executable, "-m", "orchestrator", "stop", f"--log-path={tmp_path}"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "no run is in progress" in result.stderr
