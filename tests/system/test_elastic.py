"""coordination.elastic: a worker killed (kill -9) or frozen (SIGSTOP) mid-rollout is marked
out within the node timeout, the others finish every iteration with every task exactly once,
status names it out, and the same command (or SIGCONT) brings it back at the next iteration's
start (issue 17, item 1)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from tests.harness import (
    NODE_TIMEOUT_S,
    Cluster,
    aggregate_task_ids,
    heartbeat,
    kill_tree,
    run_flags,
    status_json,
    trainer_in_update,
    wait_for,
)

pytestmark = pytest.mark.timeout(150)

TASKS, EVAL_TASKS, ITERATIONS = 36, 9, 4
ELASTIC = ["coordination.elastic=true", f"rehearsal.tasks={TASKS}", f"rehearsal.eval_tasks={EVAL_TASKS}", "rehearsal.task_s=0.08"]


def _flags(cluster, extra: list[str] = ()) -> list[str]:
    return run_flags(cluster.log_path, weights="1,1,1", eval_interval=1, max_iterations=ITERATIONS, extra=[*ELASTIC, *extra])


def _mid_rollout(layout: RunLayout, rank: int, iteration: int) -> bool:
    hb = heartbeat(layout, rank)
    progress = hb and hb.get("iteration") == iteration and hb.get("phase") == "1:rollout" and hb.get("progress")
    return bool(progress) and 0 < progress["done"] < progress["total"]


def _members(layout: RunLayout) -> dict:
    attempts = sorted(layout.attempts.iterdir())
    return fsio.read_record(layout.attempt(attempts[-1].name).members) or {}


def _events(layout: RunLayout, kind: str) -> list[dict]:
    return [e for e in _members(layout).get("events", []) if e["event"] == kind]


def _assert_each_task_once(layout: RunLayout) -> None:
    for i in range(1, ITERATIONS + 1):
        for split, n in (("train", TASKS), ("eval", EVAL_TASKS)):
            ids = aggregate_task_ids(layout, i, split)
            assert sorted(ids) == [f"{split}-{i:06d}-{k:06d}" for k in range(n)], f"iteration {i} {split}: a task missing or twice"


@pytest.mark.parametrize("how", ["kill-9", "sigstop"])
def test_a_worker_lost_mid_rollout_is_marked_out_the_others_finish_and_it_rejoins(cluster, how):
    flags = _flags(cluster)
    procs = cluster.start_all(flags)
    layout = cluster.layout
    wait_for(lambda: _mid_rollout(layout, 2, 2), 60, "rank 2 to be part-way through the rollout of iteration 2")
    if how == "kill-9":
        os.kill(procs[2].pid, signal.SIGKILL)
    else:
        os.kill(procs[2].pid, signal.SIGSTOP)
    # Marked out within the node timeout (plus a heartbeat poll), not at a barrier's deadline.
    wait_for(lambda: _events(layout, "out"), NODE_TIMEOUT_S + 5, "the master to mark rank 2 out")
    out = _events(layout, "out")[0]
    assert out["rank"] == 2 and out["iteration"] == 2 and out["phase"] == "1:rollout", out
    status = status_json(cluster.log_path)
    assert status["failure"] is None and [r["rank"] for r in status["ranks_out"]] == [2], status["ranks_out"]

    if how == "kill-9":
        assert procs[2].wait(timeout=10) == -9
        procs[2] = cluster.start(2, flags)
    else:
        os.kill(procs[2].pid, signal.SIGCONT)  # it finds itself out, and asks to come back
    wait_for(lambda: _events(layout, "rejoined"), 60, "rank 2 to rejoin")
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in procs)

    _assert_each_task_once(layout)
    rejoined = _events(layout, "rejoined")[0]
    assert rejoined["rank"] == 2 and rejoined["iteration"] > 2, rejoined
    status = status_json(cluster.log_path)
    assert status["failure"] is None and status["ranks_out"] == []
    assert [(e["event"], e["rank"]) for e in status["membership"]] == [("out", 2), ("rejoined", 2)]
    by_iteration = {it["iteration"]: it for it in status["iterations"]}
    assert by_iteration[rejoined["iteration"]]["tasks_per_rank"] == [12, 12, 12]  # back in the plan
    assert by_iteration[rejoined["iteration"] - 1]["tasks_per_rank"][2] in (0, 12)
    assert "rejoins attempt" in procs[2].output()
    if how == "kill-9":
        report = subprocess.run([sys.executable, "-m", "orchestrator", "report", f"--log-path={cluster.log_path}"],
                                capture_output=True, text=True, timeout=90)
        assert report.returncode == 0, report.stderr
        timeline = json.loads((cluster.log_path / "report" / "report.json").read_text())["timeline"]
        changes = [(m["event"], m["rank"], m["iteration"]) for m in timeline["membership"]]
        assert changes == [("out", 2, 2), ("rejoined", 2, rejoined["iteration"])]


@pytest.mark.parametrize("how", ["kill-9", "sigstop"])
def test_a_worker_lost_mid_training_is_marked_out_the_step_is_trained_again_without_it_and_it_rejoins(cluster, how):
    """Rank 2 is lost in phase 10 of iteration 2, after ranks 0 and 1 arrived at its barrier:
    the master declares a second round of that training (members.json), every rank trains the
    step again without rank 2, and it rejoins at the next iteration."""
    flags = _flags(cluster)
    layout = cluster.layout
    procs = [cluster.start(r, flags, {"ORCHESTRATOR_FAULT": "hold@2:10"} if r == 2 else None) for r in range(3)]

    def held():
        hb = heartbeat(layout, 2)
        return hb and (hb.get("iteration"), hb.get("phase"), hb.get("state")) == (2, "10:train", "held")

    wait_for(held, 60, "rank 2 to be held in the training of iteration 2")
    os.kill(procs[2].pid, signal.SIGKILL if how == "kill-9" else signal.SIGSTOP)
    if how == "kill-9":
        assert procs[2].wait(timeout=10) == -9
        procs[2] = cluster.start(2, flags)  # at once: it asks to rejoin, silent, before the master marks it out
    wait_for(lambda: _events(layout, "out"), NODE_TIMEOUT_S + 5, "the master to mark rank 2 out")
    out = _events(layout, "out")[0]
    assert (out["rank"], out["iteration"], out["phase"]) == (2, 2, "10:train"), out
    assert _members(layout)["train_round"] | {"at": 0} == {"iteration": 2, "round": 1, "out": [2], "at": 0}
    if how == "sigstop":
        os.kill(procs[2].pid, signal.SIGCONT)
    wait_for(lambda: _events(layout, "rejoined"), 60, "rank 2 to rejoin")
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in procs)

    _assert_each_task_once(layout)
    assert _events(layout, "rejoined")[0]["iteration"] > 2
    assert "training iteration 2 again (round 1) with ranks 0,1" in procs[0].output()
    assert "training it again (round 1)" in procs[1].output()
    assert not list(layout.checkpoint(2).parent.glob(".*.tmp")), "a try's staging directory is left"


def test_min_nodes_ends_the_attempt_as_without_elastic(cluster):
    """With coordination.min_nodes=3 no rank can be lost: a dead worker ends the attempt (exit 3)."""
    procs = cluster.start_all(_flags(cluster, ["coordination.min_nodes=3"]))
    wait_for(lambda: _mid_rollout(cluster.layout, 2, 1), 60, "rank 2 to be part-way through the rollout of iteration 1")
    os.kill(procs[2].pid, signal.SIGKILL)
    assert cluster.wait_all(procs, timeout=30) == [3, 3, -9]
    assert "fewer than coordination.min_nodes=3" in procs[0].output()
    assert not _events(cluster.layout, "out")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rl_run_goes_on_without_a_node_lost_mid_rollout_and_mid_training_and_takes_it_back(demo_data, tmp_path):
    """The RL loop with elastic; rank 2's node (the rank, its engine, its train worker) is
    killed twice, and each time the same command is started again at once.

    - Mid-rollout of iteration 1: ranks 0 and 1 finish its tasks and train as a group of two;
      rank 2 rejoins at iteration 2.
    - Mid-update of iteration 2: the others' trainers lose their peer; the master marks rank 2
      out and ranks 0 and 1 train iteration 2 again as two from the same checkpoint (the
      update does not depend on the worker count: tests/system/test_fsdp.py); rank 2
      rejoins at iteration 3 and trains with them."""
    cluster = Cluster(tmp=tmp_path, log_path=tmp_path / "run")
    layout = cluster.layout
    flags = [f"--data-path={demo_data}", f"--log-path={cluster.log_path}", "--rl-phase=both", "--num-nodes=3",
             "--rank-weights=1,1,2", "--eval-interval=3", "--max-iterations=3", "rl.train_tasks=64", "rl.samples_per_prompt=2",
             "rl.eval_tasks=16", "rl.eval_samples=1", "rl.epochs=1", "rl.micro_batch=4", "coordination.heartbeat_interval_s=0.5",
             "coordination.node_timeout_s=6", "coordination.join_timeout_s=120", "coordination.elastic=true",
             # Without stealing rank 2's share is one chunk of 32 tasks, reported every 16: it is
             # seen part-way through (with stealing the others may leave it a single chunk).
             "coordination.work_stealing=false"]
    procs = cluster.start_all(flags)

    def running(ranks_alive):
        assert all(p.proc.poll() is None for p in procs), "\n".join(p.output()[-3000:] for p in procs)
        return ranks_alive()

    def lose_rank_2(when, what: str, outs: int) -> None:
        wait_for(lambda: running(when), 180, what)
        kill_tree(procs[2].pid)  # the node is gone
        assert procs[2].wait(timeout=10) == -9
        procs[2] = cluster.start(2, flags)  # at once: it asks to rejoin, silent, before the master marks it out
        wait_for(lambda: len(_events(layout, "out")) == outs, 6 + 10, "the master to mark rank 2 out")

    try:
        lose_rank_2(lambda: _mid_rollout(layout, 2, 1), "rank 2 to be part-way through the rollout of iteration 1", 1)
        lose_rank_2(lambda: trainer_in_update(cluster.log_path, 2, 2), "train worker 2 to be in the update of iteration 2", 2)
        assert cluster.wait_all(procs, timeout=300) == [0, 0, 0], "\n".join(p.output()[-4000:] for p in procs)
    finally:
        cluster.kill_all()
    assert [(e["rank"], e["iteration"], e["phase"]) for e in _events(layout, "out")] == [(2, 1, "1:rollout"), (2, 2, "10:train")]
    assert [(e["rank"], e["iteration"]) for e in _events(layout, "rejoined")] == [(2, 2), (2, 3)]
    assert _members(layout)["train_round"] | {"at": 0} == {"iteration": 2, "round": 1, "out": [2], "at": 0}
    for i in (1, 2, 3):
        ids = aggregate_task_ids(layout, i)
        assert len(ids) == 64 and len(set(ids)) == 64, f"iteration {i}: a task missing or twice"
        assert layout.checkpoint(i).is_dir()
    assert [fsio.read_record(layout.iteration(i).plan)["train"]["per_rank"] for i in (1, 2, 3)] == [[16, 16, 32]] * 3
    assert json.loads((layout.checkpoint(2) / "train_stats.json").read_text())["world_size"] == 2
    attempt = layout.attempt(sorted(layout.attempts.iterdir())[-1].name)
    worlds = re.findall(r"joining rendezvous \S+ as rank \d+ of (\d+)", attempt.trainer_log(0).read_text())
    # Two trained iteration 1; three began iteration 2, two trained it again; three trained iteration 3.
    assert worlds == ["2", "3", "2", "3"], worlds
    assert not list(layout.checkpoint(2).parent.glob(".*.tmp")), "a try's staging directory is left"
