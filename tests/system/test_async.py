"""rl.max_staleness=1 on ranks apart (training on some nodes, rollout on others): the rollout
of an iteration runs while the one before trains, every trajectory within the bound, and
every fault of lockstep still ends named and resumes with every task once."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from tests.harness import (NODE_TIMEOUT_S, aggregate_records, assert_each_task_once, heartbeat, run_flags, status_json, wait_for,
                           wait_state)

pytestmark = pytest.mark.timeout(150)

ITERATIONS = 4
TASKS = 12
# Node 0 trains, nodes 1 and 2 roll out (the master is the training node) ...
TRAIN_ON_MASTER = ["rl.max_staleness=1", "train.nodes=0", "rollout.nodes=1-2"]
# ... or node 1 trains and the master rolls out with node 2.
TRAIN_ON_WORKER = ["rl.max_staleness=1", "train.nodes=1", "rollout.nodes=0,2"]


def flags(cluster, roles: list[str], *, train_s: float = 1.0, extra: list[str] = ()) -> list[str]:
    weights = "0,1,1" if "train.nodes=0" in roles else "1,0,1"
    return run_flags(cluster.log_path, weights=weights, max_iterations=ITERATIONS,
                     extra=[*roles, f"rehearsal.train_s={train_s}", "rehearsal.task_s=0.1", "checkpoint.keep_last=10", *extra])


def summaries(layout, iterations: int = ITERATIONS) -> list[dict]:
    return [fsio.read_record(layout.iteration(i).summary) for i in range(1, iterations + 1)]


def assert_complete_within_the_bound(layout, iterations: int = ITERATIONS) -> None:
    """Every iteration trained once on all its tasks, each counted once, from the checkpoint
    one before the one it trains from (staleness 1), the first from the base model."""
    assert_each_task_once(layout, iterations, tasks=TASKS)
    for i in range(1, iterations + 1):
        assert {r["policy_iteration"] for r in aggregate_records(layout, i)} == {max(0, i - 2)}, i
        marker = fsio.read_record(layout.checkpoint(i) / "marker.json")
        assert marker["iteration"] == i and marker["records"] == TASKS
    assert [s["staleness"] for s in summaries(layout, iterations)] == [[0, 0]] + [[1, 1]] * (iterations - 1)
    assert all(s["complete"] for s in summaries(layout, iterations))


def wait_mid_rollout(layout, rank: int, iteration: int) -> None:
    def mid_rollout():
        hb = heartbeat(layout, rank) or {}
        p = hb.get("iteration") == iteration and hb.get("phase") == Phase.ROLLOUT.label and hb.get("progress")
        return p and 0 < p["done"] < p["total"]

    wait_for(mid_rollout, 60, f"rank {rank} part-way through the rollout of iteration {iteration}")


def events(layout, rank: int) -> list[dict]:
    return [json.loads(line) for path in sorted(layout.attempts.glob("*/events/*")) if path.name.startswith(f"r{rank:05d}")
            for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_the_next_rollout_runs_while_an_iteration_trains_and_every_trajectory_keeps_the_bound(cluster):
    procs = cluster.start_all(flags(cluster, TRAIN_ON_MASTER, train_s=2.0))
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in procs)
    layout = cluster.layout
    assert_complete_within_the_bound(layout)
    assert status_json(cluster.log_path)["failure"] is None
    evals = [json.loads(line) for line in (cluster.log_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["iteration"], e["policy_iteration"]) for e in evals] == [(1, 0), (3, 1)]  # the checkpoint each evaluated
    # Rank 1 began rolling out iteration i+1 before the checkpoint of iteration i existed:
    # the rollout ran while the training node trained (2 s a step, the rollout 0.6 s).
    began = {e["iteration"]: e["t"] for e in events(layout, 1) if e["event"] == "phase" and e["phase"] == int(Phase.ROLLOUT)}
    for i in range(1, ITERATIONS):
        made = (layout.checkpoint(i) / "marker.json").stat().st_mtime
        assert began[i + 1] < made, f"the rollout of iteration {i + 1} waited for the checkpoint of iteration {i}"


@pytest.mark.slow
@pytest.mark.parametrize("roles,victim,where", [
    (TRAIN_ON_MASTER, 1, (2, Phase.ROLLOUT)),  # a rollout node, mid-overlap
    (TRAIN_ON_MASTER, 0, (2, Phase.SHARDS_SEALED)),  # the master, which trains, while it trains
    (TRAIN_ON_WORKER, 1, (2, Phase.ROLLOUT)),  # the training node, not the master, while it trains
], ids=["rollout-node", "master-training", "training-node"])
def test_sigkill_during_the_overlap_names_the_rank_and_the_rerun_continues_with_the_same_staleness(cluster, roles, victim, where):
    iteration, phase = where
    run = flags(cluster, roles, train_s=3.0)
    procs = cluster.start_all(run, env_for={victim: {"ORCHESTRATOR_FAULT": f"hold@{iteration}:{int(phase)}"}})
    wait_state(cluster.layout, victim, "held", timeout=60)
    assert not cluster.layout.checkpoint(1).exists(), "iteration 1 should still be training"
    if roles is TRAIN_ON_MASTER and victim == 1:  # status shows both halves
        pipe = status_json(cluster.log_path)["pipeline"]
        assert pipe.pop("phase") in (Phase.ROLLOUT.label, Phase.ROLLOUT_DONE.label)  # the master has no rollout share
        assert pipe == {"max_staleness": 1, "iteration": 2, "training": 1, "training_ranks": [0], "staleness": [0, 0]}, pipe
        text = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={cluster.log_path}"],
                              capture_output=True, text=True, timeout=30).stdout
        assert re.search(r"pipelined \(rl.max_staleness=1\): the ranks walk iteration 2, phase \d:\w+; iteration 1 trains in "
                         r"the background on rank\(s\) 0, on trajectories 0 checkpoint\(s\) old", " ".join(text.split())), text
    host = heartbeat(cluster.layout, victim)["host"]
    os.kill(procs[victim].pid, signal.SIGKILL)
    killed = time.monotonic()
    survivors = [p for p in procs if p.rank != victim]
    assert cluster.wait_all(survivors, timeout=NODE_TIMEOUT_S + 30) == [3, 3], "\n".join(p.output() for p in survivors)
    assert time.monotonic() - killed < NODE_TIMEOUT_S + 25
    for p in survivors:
        assert f"rank {victim} on host {host} died" in p.output()
    failure = status_json(cluster.log_path)["failure"]
    assert (failure["rank"], failure["iteration"], failure["phase"]) == (victim, iteration, phase.label), failure

    again = cluster.start_all(run)
    assert cluster.wait_all(again, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in again)
    assert_complete_within_the_bound(cluster.layout)


@pytest.mark.slow
def test_sigstop_of_a_rollout_node_during_the_overlap_is_detected_and_the_rerun_completes(cluster):
    run = flags(cluster, TRAIN_ON_MASTER, train_s=3.0)
    procs = cluster.start_all(run)
    wait_for(lambda: (heartbeat(cluster.layout, 2) or {}).get("iteration") == 2
             and (heartbeat(cluster.layout, 2) or {}).get("phase") == Phase.ROLLOUT.label, 60, "rank 2 rolling out iteration 2")
    os.killpg(procs[2].pid, signal.SIGSTOP)
    try:
        assert cluster.wait_all(procs[:2], timeout=NODE_TIMEOUT_S + 30) == [3, 3], "\n".join(p.output() for p in procs[:2])
        assert "rank 2 on host" in procs[0].output() and "died" in procs[0].output()
    finally:
        os.killpg(procs[2].pid, signal.SIGKILL)
        procs[2].wait(timeout=10)
    again = cluster.start_all(run)
    assert cluster.wait_all(again, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in again)
    assert_complete_within_the_bound(cluster.layout)


def test_a_pipelined_run_resumed_with_another_staleness_is_refused_before_anything_is_written(cluster):
    procs = cluster.start_all(run_flags(cluster.log_path, weights="0,1,1", max_iterations=1, extra=TRAIN_ON_MASTER))
    assert cluster.wait_all(procs, timeout=60) == [0, 0, 0], "\n".join(p.output() for p in procs)
    attempts = sorted(p.name for p in cluster.layout.attempts.iterdir())
    lockstep = [f for f in run_flags(cluster.log_path, weights="0,1,1", max_iterations=2,
                                     extra=["train.nodes=0", "rollout.nodes=1-2"])]
    master = cluster.start(0, lockstep)
    assert master.wait(timeout=30) == 2, master.output()
    assert "walks with rl.max_staleness=1" in master.output() and "resume it with rl.max_staleness=1" in master.output()
    assert sorted(p.name for p in cluster.layout.attempts.iterdir()) == attempts


@pytest.mark.slow
def test_elastic_a_rollout_node_killed_during_the_overlap_is_marked_out_its_work_redone_and_it_rejoins(cluster):
    """coordination.elastic with rl.max_staleness=1: rollout nodes are preemptible capacity.
    Rank 2 dies part-way through the rollout of iteration 2 while iteration 1 trains on node
    0; the others finish its chunks and every iteration, and the same command brings it back
    at a later iteration's start."""
    run = flags(cluster, TRAIN_ON_MASTER, train_s=2.0, extra=["coordination.elastic=true", "rehearsal.task_s=0.3"])
    procs = cluster.start_all(run)
    layout = cluster.layout

    wait_mid_rollout(layout, 2, 2)
    assert not layout.checkpoint(1).exists(), "iteration 1 should still be training"
    os.kill(procs[2].pid, signal.SIGKILL)
    assert procs[2].wait(timeout=10) == -9
    members = lambda: fsio.read_record(layout.attempt(sorted(p.name for p in layout.attempts.iterdir())[-1]).members) or {}  # noqa: E731
    wait_for(lambda: any(e["event"] == "out" for e in members().get("events", [])), NODE_TIMEOUT_S + 5, "rank 2 marked out")
    procs[2] = cluster.start(2, run)
    assert cluster.wait_all(procs, timeout=120) == [0, 0, 0], "\n".join(p.output() for p in procs)
    assert [(e["event"], e["rank"]) for e in members()["events"]] == [("out", 2), ("rejoined", 2)]
    assert_complete_within_the_bound(layout)


@pytest.mark.slow
def test_killed_during_the_overlap_and_resumed_on_fewer_nodes_it_continues_with_the_same_staleness(cluster):
    run = flags(cluster, TRAIN_ON_MASTER, train_s=2.0, extra=["rehearsal.task_s=0.3"])
    procs = cluster.start_all(run)
    layout = cluster.layout

    wait_mid_rollout(layout, 2, 2)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=10)
    two = run_flags(cluster.log_path, num_nodes=2, weights="0,1", max_iterations=ITERATIONS,
                    extra=["rl.max_staleness=1", "train.nodes=0", "rollout.nodes=1", "rehearsal.train_s=1",
                           "rehearsal.task_s=0.05", "checkpoint.keep_last=10"])
    again = cluster.start_all(two, n=2)
    assert cluster.wait_all(again, timeout=120) == [0, 0], "\n".join(p.output() for p in again)
    assert "their records so far are kept" in again[0].output()
    assert_complete_within_the_bound(layout)


@pytest.mark.slow
def test_elastic_a_training_node_killed_while_it_trains_in_the_background_has_the_step_trained_again_without_it(cluster):
    """Nodes 0 and 1 train, node 2 rolls out. Rank 1 dies while iteration 1 trains in the
    background (the ranks walk the rollout of iteration 2): the master declares a second round
    of that training, which node 0 trains again without it while node 2 rolls out on; the same
    command brings rank 1 back at the next iteration, and every iteration keeps the bound."""
    run = run_flags(cluster.log_path, weights="0,0,1", max_iterations=3,
                    extra=["rl.max_staleness=1", "train.nodes=0-1", "rollout.nodes=2", "rehearsal.train_s=8", "rehearsal.task_s=0.1",
                           "checkpoint.keep_last=10", "coordination.elastic=true"])
    layout = cluster.layout
    procs = [cluster.start(r, run, {"ORCHESTRATOR_FAULT": "hold@2:1"} if r == 1 else None) for r in range(3)]
    wait_state(layout, 1, "held", timeout=60)
    assert (heartbeat(layout, 1) or {}).get("training") == 1 and (heartbeat(layout, 0) or {}).get("training") == 1
    os.kill(procs[1].pid, signal.SIGKILL)
    assert procs[1].wait(timeout=10) == -9
    procs[1] = cluster.start(1, run)  # at once: it asks to rejoin, silent, before the master marks it out
    members = lambda: fsio.read_record(layout.attempt(sorted(p.name for p in layout.attempts.iterdir())[-1]).members) or {}  # noqa: E731
    wait_for(lambda: members().get("train_round"), NODE_TIMEOUT_S + 5, "the master to declare a second round")
    assert members()["train_round"] | {"at": 0} == {"iteration": 1, "round": 1, "out": [1], "at": 0}
    assert not layout.checkpoint(1).exists()
    assert cluster.wait_all(procs, timeout=120) == [0, 0, 0], "\n".join(p.output() for p in procs)
    assert "training iteration 1 again (round 1) with ranks 0,2" in procs[0].output()
    assert [(e["event"], e["rank"]) for e in members()["events"]] == [("out", 1), ("rejoined", 1)]
    assert_complete_within_the_bound(layout, iterations=3)
    assert not list(layout.checkpoint(1).parent.glob(".*.tmp")), "a try's staging directory is left"
