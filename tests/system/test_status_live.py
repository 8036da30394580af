"""`orchestrator status` on a live run (issue 5): with one rank slowed down on purpose, the
JSON names it as the rank the barrier waits for, the table shows it, the ETA comes from
the earlier iteration, and the event log holds work and barrier-wait durations."""

import json
import os
import subprocess
import sys

import pytest

from orchestrator.phase_table import Phase
from orchestrator.protocol.events import read_events
from tests.harness import current_attempt, run_flags, status_json, wait_for

pytestmark = pytest.mark.timeout(120)


def test_status_names_the_rank_a_barrier_waits_for(cluster):
    flags = run_flags(cluster.log_path, num_nodes=3, weights="2,1,1", max_iterations=3)
    procs = cluster.start_all(flags, n=3, env_for={2: {"ORCHESTRATOR_FAULT": "hold@2:1"}})

    def stuck():
        if not cluster.layout.lease.exists():
            return None
        snap = status_json(cluster.log_path)
        b = snap["barrier"]
        return snap if b and (b["iteration"], b["phase"]) == (2, 2) and b["arrived"] == [0, 1] else None

    # Rollout (phase 1) has no barrier of its own: the others wait at rollout_done's.
    snap = wait_for(stuck, 60, "ranks 0 and 1 to wait at the rollout_done barrier of iteration 2")
    assert [w["rank"] for w in snap["waiting_for"]] == [2]
    w = snap["waiting_for"][0]
    assert w["at"] == "1:rollout" and w["state"] == "held" and w["waited_s"] >= 0
    assert snap["eta"]["phase"] == "2:rollout_done" and snap["eta"]["iteration_remaining_s"] > 0
    assert all(r["alive"] for r in snap["ranks"])

    later = wait_for(lambda: (lambda s: s if s["waiting_for"] and s["waiting_for"][0]["waited_s"] > w["waited_s"] else None)(
        status_json(cluster.log_path)), 30, "the wait to grow")
    assert later["waiting_for"][0]["rank"] == 2

    shown = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={cluster.log_path}"],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    rank2 = [line for line in lines if line.startswith("│ 2 ")]
    assert rank2 and "<- barrier waits" in rank2[0] and "held" in rank2[0]
    assert not any("<- barrier waits" in line for line in lines if line.startswith(("│ 0 ", "│ 1 ")))
    assert any("barrier 2:rollout_done of iteration 2: 2 arrived, waits for rank 2" in line for line in lines), shown.stdout
    assert any(line.startswith("eta: phase 2:rollout_done usually takes") for line in lines), shown.stdout

    # The event log: work and barrier-wait durations of iteration 1, per rank.
    events = read_events(cluster.layout.attempt(current_attempt(cluster.layout)).events(1))
    arrive = [e for e in events if e["event"] == "arrive" and e["iteration"] == 1]
    released = [e for e in events if e["event"] == "released" and e["iteration"] == 1]
    assert arrive and all(e["work_s"] >= 0 for e in arrive)
    assert len(released) == len(arrive) and all(e["wait_s"] >= 0 for e in released)
    cluster.kill_all()
    for p in procs:
        p.wait(timeout=30)


def test_status_json_waiting_for_is_empty_when_no_barrier_waits(cluster):
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", max_iterations=1)
    procs = cluster.start_all(flags, n=2)
    assert cluster.wait_all(procs, timeout=60) == [0, 0]
    snap = status_json(cluster.log_path)
    assert snap["waiting_for"] == [] and snap["barrier"] is None and snap["eta"] is None
    assert json.loads(json.dumps(snap)) == snap

    # The iteration's time breakdown: every phase the master walked, back to back, from its
    # first phase event to the last release (a rehearsal records no train or engine parts).
    timing = snap["iterations"][0]["timing"]
    assert list(timing["phases"]) == [p.label for p in Phase]
    assert all(s >= 0 for s in timing["phases"].values())
    assert timing["total_s"] == pytest.approx(sum(timing["phases"].values()), abs=0.01)
    master = read_events(cluster.layout.attempt(snap["attempt"]).events(0))
    first = next(e for e in master if e["event"] == "phase")
    last = [e for e in master if e["event"] == "released"][-1]
    assert timing["total_s"] == pytest.approx(last["mono"] - first["mono"], abs=0.01)
    assert timing["parts"] == {}
    shown = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={cluster.log_path}"],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"})
    assert f"last iteration 1 took {timing['total_s']:.1f}s: " in shown.stdout, shown.stdout
