"""The hangs and wrong answers a randomized fault soak found, each as the fault that found it:
a master frozen past the node timeout and continued (elastic off: it stops at once naming its
own pause; elastic on: it takes its waiting workers back), a worker that wakes to a finished
run, every rank killed at once (status says so), and a rank killed while the group trains
(the rank that died is the root cause, not the trainer that lost it)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from tests.harness import (
    NODE_TIMEOUT_S,
    assert_default_three_iteration_run,
    current_attempt,
    kill_tree,
    run_flags,
    status_json,
    trainer_in_update,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WAKE_S = 10  # a woken rank acts within a few monitor polls; the margin is for a loaded machine


def _freeze_the_master_at(cluster, phase: Phase, extra: list[str]):
    flags = run_flags(cluster.log_path, extra=extra)
    procs = [cluster.start(r, flags, {"ORCHESTRATOR_FAULT": f"hold@2:{int(phase)}"} if r == 0 else None) for r in range(3)]
    wait_for(lambda: "fault injection: holding" in procs[0].output(), 60, f"the master to reach phase {phase.label}")
    os.kill(procs[0].pid, signal.SIGSTOP)  # alive, silent: its heartbeat stands still
    return flags, procs


@pytest.mark.parametrize("phase", [Phase.ROLLOUT, Phase.TRAIN], ids=lambda p: p.label)
def test_a_master_frozen_past_the_node_timeout_stops_when_it_wakes_naming_its_pause(cluster, phase):
    flags, procs = _freeze_the_master_at(cluster, phase, [])
    try:
        assert [p.wait(timeout=NODE_TIMEOUT_S + 30) for p in procs[1:]] == [3, 3]
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
    woke = time.monotonic()
    assert procs[0].wait(timeout=WAKE_S) == 3, procs[0].output()[-3000:]
    said = procs[0].output()
    assert time.monotonic() - woke < WAKE_S
    assert "rank(s) 1,2 gave up on it" in said and "This rank (0) was frozen or paused" in said, said[-3000:]
    failure = status_json(cluster.log_path)["failure"]
    assert failure["rank"] == 0 and failure["iteration"] == 2 and failure["phase"] == phase.label, failure
    rerun = cluster.start_all(flags)
    assert cluster.wait_all(rerun, timeout=90) == [0, 0, 0], rerun[0].output()[-3000:]
    assert_default_three_iteration_run(cluster.log_path)


@pytest.mark.parametrize("phase", [Phase.ROLLOUT, Phase.TRAIN], ids=lambda p: p.label)
def test_with_elastic_a_master_frozen_past_the_node_timeout_takes_its_waiting_workers_back(cluster, phase):
    flags, procs = _freeze_the_master_at(cluster, phase, ["coordination.elastic=true"])
    frozen_attempt = current_attempt(cluster.layout)
    try:
        for w in procs[1:]:
            wait_for(lambda: "Waiting up to" in w.output(), NODE_TIMEOUT_S + 20, f"rank {w.rank} to give up on the master")
    finally:
        os.kill(procs[0].pid, signal.SIGCONT)
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], procs[0].output()[-3000:]
    assert "starts a new attempt for them to join" in procs[0].output()
    assert current_attempt(cluster.layout) != frozen_attempt
    assert fsio.read_record(cluster.layout.attempt(frozen_attempt).abort)["culprit"]["rank"] == 0
    assert_default_three_iteration_run(cluster.log_path)


def test_a_worker_frozen_while_the_run_finishes_ends_at_once_when_it_wakes(cluster):
    flags = run_flags(cluster.log_path, extra=["coordination.elastic=true"])
    procs = cluster.start_all(flags, env_for={2: {"ORCHESTRATOR_FAULT": "hold@2:1"}})
    wait_for(lambda: "fault injection: holding" in procs[2].output(), 60, "rank 2 to hold in iteration 2's rollout")
    os.kill(procs[2].pid, signal.SIGSTOP)
    try:
        assert [p.wait(timeout=90) for p in procs[:2]] == [0, 0], procs[0].output()[-3000:]
    finally:
        os.kill(procs[2].pid, signal.SIGCONT)
    woke = time.monotonic()
    assert procs[2].wait(timeout=WAKE_S) == 0, procs[2].output()[-3000:]
    assert time.monotonic() - woke < WAKE_S
    assert "completed without it" in procs[2].output()


def test_status_says_when_no_rank_is_alive_any_more_and_where_each_was(cluster):
    flags = run_flags(cluster.log_path, extra=["rehearsal.work_s=0.5"])
    procs = cluster.start_all(flags)
    wait_for(lambda: (fsio.read_record(cluster.layout.progress) or {}).get("iteration") == 2, 60, "iteration 2")
    cluster.kill_all()
    killed = time.time()
    for p in procs:
        p.wait(timeout=10)
    wait_for(lambda: status_json(cluster.log_path)["gone"] is not None, NODE_TIMEOUT_S + 10, "status to see every rank gone")
    gone = status_json(cluster.log_path)["gone"]
    assert [r["rank"] for r in gone["last"]] == [0, 1, 2] and all(r["iteration"] in (2, 3) and r["phase"] for r in gone["last"]), gone
    assert gone["since"] <= killed + 1 and gone["since_s"] >= NODE_TIMEOUT_S
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={cluster.log_path}"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "1000"}).stdout
    assert re.search(r"no rank alive since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text), text
    assert re.search(r"rank 1 \(\S+\) at iteration \d, phase \d+:\w+ \(\w+\)", text), text
    assert "Re-run the same commands on every node to resume" in text
    rerun = cluster.start_all(flags)
    assert cluster.wait_all(rerun, timeout=90) == [0, 0, 0]
    assert status_json(cluster.log_path)["gone"] is None


@pytest.mark.timeout(300)
def test_a_rank_killed_while_the_group_trains_is_the_root_cause_not_the_trainer_that_lost_it(demo_data, cluster):
    """The heartbeat interval at its largest (a quarter of the node timeout), and the node
    killed just after a beat: the master's verdict comes up to a heartbeat read later than a
    node timeout after the death. The survivor's trainer loses its peer at once and must wait
    that long before it names itself."""
    log_path = cluster.log_path
    flags = [f"--data-path={demo_data}", f"--log-path={log_path}", "--rl-phase=both", "--eval-interval=2", "--num-nodes=2",
             "--rank-weights=1,1", "--max-iterations=2", "rl.train_tasks=8", "rl.samples_per_prompt=4", "rl.eval_tasks=8",
             "rl.eval_samples=1", "rl.epochs=50", "rl.micro_batch=4", "coordination.node_timeout_s=12",
             "coordination.heartbeat_interval_s=3", "coordination.join_timeout_s=60"]
    # Rank 1's train worker is frozen (SIGSTOP) once in the update, so that the update, which
    # waits on its collectives, outlasts the wait for rank 1's next beat (up to 3 s) and the
    # node dies in phase 10: 100 packed steps of this size take well under a second.
    procs = cluster.start_all(flags, n=2)
    try:
        def in_update():
            assert all(p.proc.poll() is None for p in procs), [p.proc.returncode for p in procs]
            return trainer_in_update(log_path, 1, 1)

        trainer = wait_for(in_update, 200, "train worker 1 in the update of iteration 1")
        os.kill(trainer, signal.SIGSTOP)
        attempt = cluster.layout.attempt(current_attempt(cluster.layout))
        beat = fsio.read_record(attempt.heartbeat(1))["counter"]
        wait_for(lambda: fsio.read_record(attempt.heartbeat(1))["counter"] > beat, 10, "rank 1's next heartbeat", interval=0.005)
        kill_tree(procs[1].pid)  # the node, just after a beat: rank 1, its engine and its trainer
        assert procs[0].wait(timeout=60) == 3, procs[0].output()[-3000:]
    finally:
        cluster.kill_all()
    failure = status_json(log_path)["failure"]
    assert failure["rank"] == 1 and failure["kind"] == "dead" and failure["phase"] == "10:train", failure
    assert "rank 1 on host" in procs[0].output() and "died (heartbeat stopped)" in procs[0].output()
