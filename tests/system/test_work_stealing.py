"""Work stealing (coordination.work_stealing): ranks that finish take a slow rank's chunks not
yet started, status shows who took what, and a kill -9 at any step of a steal loses and
duplicates nothing (issue 17, items 3, 5 and 6)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from orchestrator.data import claims
from orchestrator.protocol import fsio
from tests.harness import assert_each_task_once, run_flags, status_json, wait_state

pytestmark = pytest.mark.timeout(150)

TASKS = 36
SLOW = ["rehearsal.tasks=36", "rehearsal.eval_tasks=9", "rehearsal.task_s=0.03", "rehearsal.slow_ranks=2:4"]
EQUAL = dict(weights="1,1,1", eval_interval=1)  # equal shares: rank 2 is slow by its tasks' time alone


def test_fast_ranks_take_a_slow_ranks_chunks_and_status_and_report_show_it(cluster):
    procs = cluster.start_all(run_flags(cluster.log_path, **EQUAL, max_iterations=2, extra=SLOW))
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in procs)
    assert_each_task_once(cluster.layout, 2, tasks=TASKS, eval_tasks=9)
    iterations = status_json(cluster.log_path)["iterations"]
    for it in iterations:
        assert it["tasks_per_rank"] == [12, 12, 12]
        done, taken = it["tasks_done_per_rank"], it["tasks_taken_per_rank"]
        assert sum(done) == TASKS and done[2] < 12 < min(done[0], done[1]), it
        assert taken[2] == 12 - done[2] > 0 and taken[0] == taken[1] == 0, it
    assert "took train chunk" in procs[0].output() + procs[1].output()

    out = subprocess.run([sys.executable, "-m", "orchestrator", "report", f"--log-path={cluster.log_path}"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    steals = json.loads((cluster.log_path / "report" / "report.json").read_text())["timeline"]["steals"]
    for it in iterations:
        train = [st for st in steals if st["iteration"] == it["iteration"] and st["split"] == "train"]
        assert {st["victim"] for st in train} == {2} and {st["rank"] for st in train} <= {0, 1}
        assert sum(st["tasks"] for st in train) == it["tasks_taken_per_rank"][2]


def test_without_stealing_each_rank_does_exactly_its_share(cluster):
    procs = cluster.start_all(run_flags(cluster.log_path, **EQUAL, max_iterations=1, extra=[*SLOW, "coordination.work_stealing=false"]))
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in procs)
    assert_each_task_once(cluster.layout, 1, tasks=TASKS, eval_tasks=9)
    it = status_json(cluster.log_path)["iterations"][0]
    assert it["tasks_done_per_rank"] == [12, 12, 12] and it["tasks_taken_per_rank"] == [0, 0, 0]


# The fast lane (-m "not slow") kills in the step with a claim left to settle; the steps either
# side of it are the same test again at 5 s each.
@pytest.mark.parametrize("point", [pytest.param("before-steal", marks=pytest.mark.slow), "in-steal",
                                   pytest.param("after-steal", marks=pytest.mark.slow)])
def test_kill_9_in_the_middle_of_a_steal_loses_and_duplicates_nothing(cluster, point):
    """Rank 1 is killed while it takes one of rank 2's chunks: with the chunk listed in its
    stolen.r00001.json and no claim created ("before-steal": the chunk stays free), with the
    claim created but empty ("in-steal": void once it has settled, so the chunk is claimed
    again at the next generation), or written with no record of the chunk yet ("after-steal":
    rank 1, restarted, finds it through its list and does it). The other ranks stop (exit 3);
    the same commands finish the run."""
    flags = run_flags(cluster.log_path, **EQUAL, max_iterations=1, extra=SLOW)
    procs = cluster.start_all(flags, env_for={1: {"ORCHESTRATOR_FAULT": f"hold-{point}@1:1"}})
    wait_state(cluster.layout, 1, "held", timeout=60)
    os.kill(procs[1].pid, signal.SIGKILL)
    assert cluster.wait_all(procs, timeout=30) == [3, -9, 3]
    it = cluster.layout.iteration(1)
    bodies = {p.name: fsio.read_record(p) for p in it.claims("train").glob("c*.json")}
    stolen = [name for name, body in bodies.items() if body is None or (body["rank"] == 1 and body["first_rank"] == 2)]
    listed = fsio.read_record(it.stolen("train", 1))["chunks"]  # (with any chunk whose claim it lost to another rank)
    if point == "before-steal":
        assert len(listed) == 1 and stolen == [], (listed, bodies)
        chunk = listed[0]
        assert not any(body["rank"] == 1 and body["chunk"] == chunk for body in bodies.values()), bodies
    else:
        assert len(stolen) == 1, bodies
        chunk = int(stolen[0][1:6])
        assert chunk in listed, (listed, bodies)  # listed before its claim was created

    again = cluster.start_all(flags)
    assert cluster.wait_all(again, timeout=90) == [0, 0, 0], "\n".join(p.output() for p in again)
    assert_each_task_once(cluster.layout, 1, tasks=TASKS, eval_tasks=9)
    owner = claims.owners(it, "train", claims.chunks_of(fsio.read_record(it.plan)["train"]))[chunk]
    if point == "in-steal":
        assert fsio.read_record(it.claim("train", chunk, 0)) is None and fsio.read_record(it.claim("train", chunk, 1)) is not None
    elif point == "after-steal":
        assert owner == 1
