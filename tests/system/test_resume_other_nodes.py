"""A run killed mid-rollout continues on another number of nodes with the same --log-path:
sealed shards kept, the absent ranks' records kept and their unfinished tasks redone by the
new ranks, every task exactly once; a change that would alter an interrupted iteration's
tasks is exit 2 before anything is written (issue 17, item 4)."""

import subprocess
import sys

import pytest

from orchestrator.protocol import fsio
from tests.harness import assert_each_task_once, kill_tree, run_flags, status_json, wait_mid_rollout

pytestmark = pytest.mark.timeout(180)

TASKS = 24
SLOW = ["rehearsal.tasks=24", "rehearsal.eval_tasks=6", "rehearsal.task_s=0.1"]
RUN = dict(eval_interval=1, max_iterations=2, extra=SLOW)  # whatever the number of ranks, with equal weights


def _kill_all_mid_rollout(cluster, n: int, rank: int) -> None:
    procs = cluster.start_all(run_flags(cluster.log_path, num_nodes=n, weights=",".join("1" * n), **RUN), n=n)
    try:
        wait_mid_rollout(cluster.layout, rank, timeout=60)
    finally:
        for p in procs:
            kill_tree(p.pid)
    for p in procs:
        p.wait(timeout=10)


def test_three_ranks_killed_mid_rollout_finish_on_two(cluster):
    _kill_all_mid_rollout(cluster, 3, rank=2)
    it = cluster.layout.iteration(1)
    partial = [line for line in it.shard("train", 2).read_text().splitlines() if line.endswith("}")]
    assert fsio.read_record(it.shard_manifest("train", 2)) is None and partial, "rank 2 was part-way through its share"

    again = cluster.start_all(run_flags(cluster.log_path, num_nodes=2, weights="1,1", **RUN), n=2)
    assert cluster.wait_all(again, timeout=120) == [0, 0], "\n".join(p.output() for p in again)
    assert "ranks 2 have train work in iteration 1 but this run has 2 node(s)" in again[0].output()
    assert_each_task_once(cluster.layout, 2, tasks=TASKS, eval_tasks=6)
    assert it.adopted_shard("train", 2).read_text().splitlines() == partial
    assert fsio.read_record(it.adopted_shard("train", 2).with_name("r00002.adopted.manifest.json"))["adopted"] is True
    status = status_json(cluster.log_path)
    assert status["failure"] is None and status["num_nodes"] == 2
    first = status["iterations"][0]
    assert first["tasks_per_rank"] == [8, 8, 8] and sum(first["tasks_done_per_rank"]) == TASKS
    assert first["tasks_done_per_rank"][2] >= len(partial)
    assert status["iterations"][1]["tasks_per_rank"] == [12, 12]


def test_two_ranks_killed_mid_rollout_finish_on_four(cluster):
    _kill_all_mid_rollout(cluster, 2, rank=1)
    again = cluster.start_all(run_flags(cluster.log_path, num_nodes=4, weights="1,1,1,1", **RUN), n=4)
    assert cluster.wait_all(again, timeout=120) == [0, 0, 0, 0], "\n".join(p.output() for p in again)
    assert_each_task_once(cluster.layout, 2, tasks=TASKS, eval_tasks=6)
    status = status_json(cluster.log_path)
    assert status["failure"] is None and status["num_nodes"] == 4
    assert sum(status["iterations"][0]["tasks_done_per_rank"]) == TASKS
    assert status["iterations"][1]["tasks_per_rank"] == [6, 6, 6, 6]


@pytest.mark.parametrize("change", [["--rl-phase=update"], ["seed=7"], ["rehearsal.tasks=30"], ["--no-rehearsal"]],
                         ids=["rl-phase", "seed", "tasks", "workload"])
def test_a_change_that_alters_an_interrupted_iteration_is_exit_2_naming_the_key(cluster, change):
    _kill_all_mid_rollout(cluster, 2, rank=1)
    before = sorted(str(p.relative_to(cluster.log_path)) for p in cluster.log_path.rglob("*"))
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", **RUN)
    flags = [f for f in flags if not (change[0].startswith("--rl-phase") and f.startswith("--rl-phase"))]
    if change == ["--no-rehearsal"]:  # the real loop against a rehearsal's iteration: said by the flag, not as workload=
        flags, change = [f for f in flags if f != "--rehearsal"], []
    out = subprocess.run([sys.executable, "-m", "orchestrator", "run", *flags, *change, "--master"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    text = " ".join(out.stderr.split())
    key = change[0].split("=")[0] if change else "resume it with --rehearsal"
    assert "is inside iteration 1, before phase 1:rollout (stopped there, or still walked by its master" in text and key in text, text
    assert "workload=" not in text
    assert sorted(str(p.relative_to(cluster.log_path)) for p in cluster.log_path.rglob("*")) == before
