"""coordination.elastic: a worker killed (kill -9) or frozen (SIGSTOP) mid-rollout is marked
out within the node timeout, the others finish every iteration with every task exactly once,
status names it out, and the same command (or SIGCONT) brings it back at the next iteration's
start (issue 17, item 1). A node that serves a model beside the policy (a teacher) and dies is
failed over from and handled as any dead node."""

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
    aggregate_records,
    aggregate_task_ids,
    assert_each_task_once,
    heartbeat,
    hold_after_first_batch,
    held_mid_rollout,
    kill_tree,
    run_flags,
    status_json,
    trainer_in_update,
    wait_for,
)

pytestmark = pytest.mark.timeout(150)

TASKS, EVAL_TASKS, ITERATIONS = 36, 9, 4
ELASTIC = ["coordination.elastic=true", f"rehearsal.tasks={TASKS}", f"rehearsal.eval_tasks={EVAL_TASKS}", "rehearsal.task_s=0.08"]
RUN = dict(weights="1,1,1", eval_interval=1, max_iterations=ITERATIONS)  # equal shares; every iteration evaluated, so eval tasks count too


def _mid_rollout(layout: RunLayout, rank: int, iteration: int) -> bool:
    hb = heartbeat(layout, rank)
    progress = hb and hb.get("iteration") == iteration and hb.get("phase") == "1:rollout" and hb.get("progress")
    return bool(progress) and 0 < progress["done"] < progress["total"]


def _members(layout: RunLayout) -> dict:
    attempts = sorted(layout.attempts.iterdir())
    return fsio.read_record(layout.attempt(attempts[-1].name).members) or {}


def _events(layout: RunLayout, kind: str) -> list[dict]:
    return [e for e in _members(layout).get("events", []) if e["event"] == kind]


def _elastic_rl_flags(demo_data, cluster: Cluster, *, weights: str, iterations: int, extra: list[str]) -> list[str]:
    """Three nodes of the RL loop with elastic, 64 tasks at 2 samples, a 6 s node timeout."""
    return [f"--data-path={demo_data}", f"--log-path={cluster.log_path}", "--rl-phase=both", "--num-nodes=3",
            f"--rank-weights={weights}", "--eval-interval=4", f"--max-iterations={iterations}", "rl.train_tasks=64",
            "rl.samples_per_prompt=2", "rollout.max_inflight=16", "rollout.prompts_per_request=4", "rl.eval_samples=1",
            "coordination.heartbeat_interval_s=0.5", "coordination.node_timeout_s=6", "coordination.join_timeout_s=120",
            "coordination.elastic=true", "coordination.fan_in=2", *extra]


def _while_all_run(procs: list, ready, what: str, timeout: float = 180):
    """Wait for ``ready()``, failing at once (with their output) if a rank exits meanwhile."""
    def check():
        assert all(p.proc.poll() is None for p in procs), "\n".join(p.output()[-3000:] for p in procs)
        return ready()
    return wait_for(check, timeout, what)


def _kill_node_and_start_again(cluster: Cluster, procs: list, rank: int, flags: list[str], env: dict | None = None) -> None:
    """kill -9 of ``rank``'s node (the rank, its engines, its train worker), and the same
    command at once: it asks to rejoin, silent, before the master marks it out."""
    kill_tree(procs[rank].pid)
    assert procs[rank].wait(timeout=10) == -9
    procs[rank] = cluster.start(rank, flags, env)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill-9", "sigstop"])
def test_a_worker_lost_mid_rollout_is_marked_out_the_others_finish_and_it_rejoins(cluster, how):
    """Killed: rank 1, which leads the group of ranks 1 and 2 (the harness forces
    coordination.fan_in=2), so rank 2 leads it from then on; frozen: rank 2, a member."""
    victim = 1 if how == "kill-9" else 2
    flags = run_flags(cluster.log_path, **RUN, extra=ELASTIC)
    procs = cluster.start_all(flags)
    layout = cluster.layout
    wait_for(lambda: _mid_rollout(layout, victim, 2), 60, f"rank {victim} to be part-way through the rollout of iteration 2")
    if how == "kill-9":
        os.kill(procs[victim].pid, signal.SIGKILL)
    else:
        os.kill(procs[victim].pid, signal.SIGSTOP)
    # Marked out within the node timeout (plus a heartbeat poll), not at a barrier's deadline.
    wait_for(lambda: _events(layout, "out"), NODE_TIMEOUT_S + 5, f"the master to mark rank {victim} out")
    out = _events(layout, "out")[0]
    assert out["rank"] == victim and out["iteration"] == 2 and out["phase"] == "1:rollout", out
    status = status_json(cluster.log_path)
    assert status["failure"] is None and [r["rank"] for r in status["ranks_out"]] == [victim], status["ranks_out"]

    if how == "kill-9":
        assert procs[victim].wait(timeout=10) == -9
        procs[victim] = cluster.start(victim, flags)
    else:
        os.kill(procs[victim].pid, signal.SIGCONT)  # it finds itself out, and asks to come back
    wait_for(lambda: _events(layout, "rejoined"), 60, f"rank {victim} to rejoin")
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in procs)

    assert_each_task_once(layout, ITERATIONS, tasks=TASKS, eval_tasks=EVAL_TASKS)
    rejoined = _events(layout, "rejoined")[0]
    assert rejoined["rank"] == victim and rejoined["iteration"] > 2, rejoined
    status = status_json(cluster.log_path)
    assert status["failure"] is None and status["ranks_out"] == []
    assert [(e["event"], e["rank"]) for e in status["membership"]] == [("out", victim), ("rejoined", victim)]
    by_iteration = {it["iteration"]: it for it in status["iterations"]}
    assert by_iteration[rejoined["iteration"]]["tasks_per_rank"] == [12, 12, 12]  # back in the plan
    assert by_iteration[rejoined["iteration"] - 1]["tasks_per_rank"][victim] in (0, 12)
    assert "rejoins attempt" in procs[victim].output()
    if how == "kill-9":
        report = subprocess.run([sys.executable, "-m", "orchestrator", "report", f"--log-path={cluster.log_path}"],
                                capture_output=True, text=True, timeout=90)
        assert report.returncode == 0, report.stderr
        timeline = json.loads((cluster.log_path / "report" / "report.json").read_text())["timeline"]
        changes = [(m["event"], m["rank"], m["iteration"]) for m in timeline["membership"]]
        assert changes == [("out", victim, 2), ("rejoined", victim, rejoined["iteration"])]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill-9", "sigstop"])
def test_a_worker_lost_mid_training_is_marked_out_the_step_is_trained_again_without_it_and_it_rejoins(cluster, how):
    """Rank 2 is lost in phase 10 of iteration 2, after ranks 0 and 1 arrived at its barrier:
    the master declares a second round of that training (members.json), every rank trains the
    step again without rank 2, and it rejoins at the next iteration."""
    flags = run_flags(cluster.log_path, **RUN, extra=ELASTIC)
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

    assert_each_task_once(layout, ITERATIONS, tasks=TASKS, eval_tasks=EVAL_TASKS)
    assert _events(layout, "rejoined")[0]["iteration"] > 2
    assert "training iteration 2 again (round 1) with ranks 0,1" in procs[0].output()
    assert "training it again (round 1)" in procs[1].output()
    assert not list(layout.checkpoint(2).parent.glob(".*.tmp")), "a try's staging directory is left"


def test_min_nodes_ends_the_attempt_as_without_elastic(cluster):
    """With coordination.min_nodes=3 no rank can be lost: a dead worker ends the attempt (exit 3)."""
    procs = cluster.start_all(run_flags(cluster.log_path, **RUN, extra=[*ELASTIC, "coordination.min_nodes=3"]))
    wait_for(lambda: _mid_rollout(cluster.layout, 2, 1), 60, "rank 2 to be part-way through the rollout of iteration 1")
    os.kill(procs[2].pid, signal.SIGKILL)
    assert cluster.wait_all(procs, timeout=30) == [3, 3, -9]
    assert "fewer than coordination.min_nodes=3" in procs[0].output()
    assert not _events(cluster.layout, "out")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rl_run_goes_on_without_a_node_killed_or_frozen_mid_rollout_or_killed_mid_training_and_takes_it_back(demo_data, tmp_path):
    """The RL loop with elastic; rank 2 is lost three times and comes back each time.

    - Iteration 1, mid-rollout: its node (the rank, its engine, its train worker) is killed
      and the same command started again at once. Ranks 0 and 1 finish its tasks and train as
      a group of two; rank 2 rejoins at iteration 2.
    - Iteration 2, mid-rollout: the rank is frozen (SIGSTOP; its engine runs on). Marked out,
      it is continued (SIGCONT), finds itself out and rejoins at iteration 3.
    - Iteration 3, mid-update: its node is killed and the command started again at once. The
      others' trainers lose their peer; the master marks rank 2 out and ranks 0 and 1 train
      iteration 3 again as two from the same checkpoint (the update does not depend on the
      worker count: tests/system/test_fsdp.py); rank 2 rejoins at iteration 4."""
    cluster = Cluster(tmp=tmp_path, log_path=tmp_path / "run")
    layout = cluster.layout
    flags = _elastic_rl_flags(demo_data, cluster, weights="1,1,2", iterations=4, extra=[
        "rl.eval_tasks=16", "rl.epochs=1", "rl.micro_batch=4",
        "checkpoint.keep_last=4",  # the test reads every iteration's checkpoint
        # Without stealing rank 2's share is its own: one chunk of 32 tasks, written in two
        # batches of 16. hold-after-batch holds it after the first (16 records fsynced).
        "coordination.work_stealing=false"])
    procs = cluster.start_all(flags, env_for=hold_after_first_batch(2, 1))

    def marked_out(times: int) -> None:
        wait_for(lambda: len(_events(layout, "out")) == times, 6 + 10, "the master to mark rank 2 out")

    def held(iteration: int) -> None:
        _while_all_run(procs, lambda: held_mid_rollout(layout, 2, iteration), f"rank 2 to be held part-way through the rollout of iteration {iteration}")

    try:
        held(1)
        _kill_node_and_start_again(cluster, procs, 2, flags, hold_after_first_batch(2, 2)[2])
        marked_out(1)
        held(2)
        os.kill(procs[2].pid, signal.SIGSTOP)
        marked_out(2)
        # Ranks 0 and 1 are frozen until rank 2 has asked to come back, so that it is admitted
        # at iteration 3's start however soon they would finish iteration 2 without it.
        join = layout.attempt(sorted(layout.attempts.iterdir())[-1].name).join(2)
        asked_before = join.read_text()
        for p in procs[:2]:
            os.kill(p.pid, signal.SIGSTOP)
        try:
            os.kill(procs[2].pid, signal.SIGCONT)  # it finds itself out, stops its work and asks to come back
            wait_for(lambda: join.read_text() != asked_before, 30, "rank 2 to ask to rejoin")
        finally:
            for p in procs[:2]:
                os.kill(p.pid, signal.SIGCONT)
        _while_all_run(procs, lambda: trainer_in_update(cluster.log_path, 2, 3), "train worker 2 to be in the update of iteration 3")
        _kill_node_and_start_again(cluster, procs, 2, flags)
        marked_out(3)
        assert cluster.wait_all(procs, timeout=300) == [0, 0, 0], "\n".join(p.output()[-4000:] for p in procs)
    finally:
        cluster.kill_all()
    assert [(e["rank"], e["iteration"], e["phase"]) for e in _events(layout, "out")] == [
        (2, 1, "1:rollout"), (2, 2, "1:rollout"), (2, 3, "10:train")]
    assert [(e["rank"], e["iteration"]) for e in _events(layout, "rejoined")] == [(2, 2), (2, 3), (2, 4)]
    assert _members(layout)["train_round"] | {"at": 0} == {"iteration": 3, "round": 1, "out": [2], "at": 0}
    for i in (1, 2, 3, 4):
        ids = aggregate_task_ids(layout, i)
        assert len(ids) == 64 and len(set(ids)) == 64, f"iteration {i}: a task missing or twice"
        assert layout.checkpoint(i).is_dir()
    assert [fsio.read_record(layout.iteration(i).plan)["train"]["per_rank"] for i in (1, 2, 3, 4)] == [[16, 16, 32]] * 4
    assert json.loads((layout.checkpoint(3) / "train_stats.json").read_text())["world_size"] == 2
    attempt = layout.attempt(sorted(layout.attempts.iterdir())[-1].name)
    updates = re.findall(r"trainer rank \d+/(\d+) .*: update of iteration (\d+)", attempt.trainer_log(0).read_text())
    # Two trained iterations 1 and 2 (one group, kept alive); three began iteration 3, two
    # trained it again; three trained iteration 4.
    assert updates == [("2", "1"), ("2", "2"), ("3", "3"), ("2", "3"), ("3", "4")], updates
    assert not list(layout.checkpoint(3).parent.glob(".*.tmp")), "a try's staging directory is left"


@pytest.mark.slow
def test_rl_pipelined_a_training_node_killed_mid_update_in_the_background_is_trained_around_and_rejoins(demo_data, tmp_path):
    """rl.max_staleness=1, nodes 0 and 1 train (one gloo group), node 2 rolls out. Rank 1's
    node is killed while its trainer is in the update of iteration 1, which runs in the
    background as the ranks walk the rollout of iteration 2: rank 0's trainer loses its peer,
    the master declares a second round, and node 0 trains iteration 1 again alone while node 2
    rolls out on. Rank 1, started again at once, rejoins at iteration 3 and trains with it."""
    cluster = Cluster(tmp=tmp_path, log_path=tmp_path / "run")
    layout = cluster.layout
    flags = _elastic_rl_flags(demo_data, cluster, weights="0,0,1", iterations=3, extra=[
        "rl.eval_tasks=16", "rl.epochs=2", "rl.micro_batch=2", "checkpoint.keep_last=4", "rl.max_staleness=1", "train.nodes=0-1",
        "rollout.nodes=2"])
    procs = cluster.start_all(flags)
    try:
        _while_all_run(procs, lambda: trainer_in_update(cluster.log_path, 1, 1), "train worker 1 in the update of iteration 1")
        _kill_node_and_start_again(cluster, procs, 1, flags)
        assert cluster.wait_all(procs, timeout=240) == [0, 0, 0], "\n".join(p.output()[-4000:] for p in procs)
    finally:
        cluster.kill_all()
    members = fsio.read_record(layout.attempt(sorted(p.name for p in layout.attempts.iterdir())[-1]).members)
    assert [(e["event"], e["rank"]) for e in members["events"]] == [("out", 1), ("rejoined", 1)]
    assert members["events"][1]["iteration"] == 3
    assert "training iteration 1 again (round 1) with ranks 0,2" in procs[0].output()
    sizes = [json.loads((layout.checkpoint(i) / "train_stats.json").read_text())["world_size"] for i in (1, 2, 3)]
    assert sizes == [1, 1, 2], sizes
    for i in (1, 2, 3):
        ids = aggregate_task_ids(layout, i)
        assert len(ids) == len(set(ids)) == 64
    assert [it["staleness"] for it in status_json(cluster.log_path)["iterations"]] == [[0, 0], [1, 1], [1, 1]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_serving_the_teacher_killed_while_asked_is_failed_over_marked_out_and_rejoins(demo_data, tmp_path):
    """A model beside the policy served by nodes of its own: rank 0 trains and rolls out, and
    the teacher (rl.teacher) is served by ranks 1 and 2 alone (models.teacher.nodes=1-2), whose
    engines rank 0 finds by their address records and asks across nodes. Rank 2's node is
    killed once its teacher engine has answered rank 0, and the same command started again at
    once: rank 0 sends what it had asked of rank 2 to rank 1's engine, the master marks rank 2
    out, and rank 2 rejoins at iteration 2. Every train sample of both iterations is scored by
    the teacher, every task exactly once.

    The kill waits on the engine's own request log, not on a rollout batch boundary (a stage
    may make a rank's first durable batch its whole share)."""
    cluster = Cluster(tmp=tmp_path, log_path=tmp_path / "run")
    layout = cluster.layout
    flags = _elastic_rl_flags(demo_data, cluster, weights="1,0,0", iterations=2, extra=[
        "rl.eval_tasks=8", "rl.epochs=1", "rl.micro_batch=4", "train.nodes=0", "rollout.nodes=0",
        f"models.teacher.path={demo_data / 'model'}", "models.teacher.nodes=1-2", "rl.teacher=teacher", "rl.distill_coef=1"])
    teacher_log = layout.engine_log(2, 0, "teacher")
    procs = cluster.start_all(flags)
    try:
        _while_all_run(procs, lambda: teacher_log.exists() and " POST /v1/completions 200 " in teacher_log.read_text(errors="replace"),
                       "rank 2's teacher engine to answer rank 0")
        _kill_node_and_start_again(cluster, procs, 2, flags)
        assert cluster.wait_all(procs, timeout=240) == [0, 0, 0], "\n".join(p.output()[-4000:] for p in procs)
    finally:
        cluster.kill_all()
    assert [(e["rank"], e["iteration"], e["phase"]) for e in _events(layout, "out")] == [(2, 1, "1:rollout")]
    assert [(e["rank"], e["iteration"]) for e in _events(layout, "rejoined")] == [(2, 2)]
    assert re.search(r"models\.teacher at http://\S+ stopped answering .*: its requests go to the others", procs[0].output())
    assert not layout.engine_log(0, 0, "teacher").exists(), "rank 0 serves no teacher: it asks ranks 1 and 2"
    for i in (1, 2):
        records = aggregate_records(layout, i)
        assert sorted(r["task_id"] for r in records) == sorted({r["task_id"] for r in records}) and len(records) == 64
        assert all(len(s["teacher_logprobs"]) == len(s["token_ids"]) for r in records for s in r["samples"])
