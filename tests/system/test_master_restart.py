"""The master killed in each phase and restarted alone while the workers wait (issue 6):
with coordination.master_wait_s set, workers that see the master die leave its attempt,
wait for a new master, and finish the run with it; every task is accounted for once.
With coordination.elastic they wait so by default (issue 17, item 2)."""

import time

import pytest

from orchestrator.phase_table import Phase
from tests.harness import NODE_TIMEOUT_S, assert_default_three_iteration_run, kill_tree, run_flags, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MASTER_WAIT_S = 60


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.label)
def test_master_killed_then_restarted_alone(cluster, phase):
    _kill_the_master_and_restart_it_alone(cluster, phase, [f"coordination.master_wait_s={MASTER_WAIT_S}"])


@pytest.mark.parametrize("phase", [Phase.TRAIN], ids=lambda p: p.label)
def test_with_elastic_workers_wait_for_a_restarted_master_without_being_told(cluster, phase):
    texts = _kill_the_master_and_restart_it_alone(cluster, phase, ["coordination.elastic=true", f"coordination.join_timeout_s={MASTER_WAIT_S}"])
    assert all(f"Waiting up to {MASTER_WAIT_S} s (coordination.master_wait_s)" in t for t in texts)


def _kill_the_master_and_restart_it_alone(cluster, phase: Phase, extra: list[str]) -> list[str]:
    """Returns the workers' output."""
    flags = run_flags(cluster.log_path, extra=extra)
    master = cluster.start(0, flags, env={"ORCHESTRATOR_FAULT": f"hold@2:{int(phase)}"})
    workers = [cluster.start(r, flags) for r in (1, 2)]
    wait_for(lambda: "fault injection: holding" in master.output(), 60, f"the master to reach phase {phase.label}")
    kill_tree(master.pid)
    master.wait(timeout=10)
    killed = time.monotonic()
    for w in workers:
        wait_for(lambda: "Waiting up to" in w.output(), NODE_TIMEOUT_S + 15, f"rank {w.rank} to notice the master died")
    detected = time.monotonic() - killed
    for w in workers:
        text = w.output()
        assert "rank 0" in text and "iteration 2" in text and "died" in text, text[-2000:]
        assert w.proc.poll() is None  # waiting, not gone
    again = cluster.start(0, flags)
    assert again.wait(timeout=90) == 0, again.output()[-3000:]
    assert [w.wait(timeout=30) for w in workers] == [0, 0], workers[0].output()[-3000:]
    assert_default_three_iteration_run(cluster.log_path)
    print(f"{phase.label}: workers noticed the master's death {detected:.1f} s after the kill (node timeout {NODE_TIMEOUT_S:g} s)")
    return [w.output() for w in workers]


def test_workers_give_up_when_no_master_comes_back(cluster):
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", extra=["coordination.master_wait_s=3"])
    master = cluster.start(0, flags, env={"ORCHESTRATOR_FAULT": "hold@1:1"})
    worker = cluster.start(1, flags)
    wait_for(lambda: "fault injection: holding" in master.output(), 60, "the master to hold")
    kill_tree(master.pid)
    code = worker.wait(timeout=NODE_TIMEOUT_S + 3 + 10 + 15)  # detection + master_wait_s + grace + slack
    assert code == 3
    assert "no master started an attempt" in worker.output()
