"""Three ranks as separate processes walk the full protocol (issue 2, done-when 2)."""

import json

import pytest

from tests.harness import assert_default_three_iteration_run, run_flags, status_json

pytestmark = pytest.mark.timeout(90)


def test_three_rank_rehearsal_completes_with_weighted_split_and_eval_schedule(cluster):
    flags = run_flags(cluster.log_path)
    procs = cluster.start_all(flags)
    codes = cluster.wait_all(procs, timeout=60)
    assert codes == [0, 0, 0], "\n".join(p.output() for p in procs)

    assert_default_three_iteration_run(cluster.log_path)
    lines = (cluster.log_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 3]
    evals = [line for line in procs[0].output().splitlines() if "eval of iteration" in line]
    assert len(evals) == 2 and all("(simulated by the rehearsal: no model ran): accuracy=" in line for line in evals), evals


def test_largest_remainder_split_is_visible_in_status(cluster):
    flags = run_flags(cluster.log_path, max_iterations=1, extra=["rehearsal.tasks=10"])
    procs = cluster.start_all(flags)
    assert cluster.wait_all(procs, timeout=60) == [0, 0, 0], "\n".join(p.output() for p in procs)
    # 10 * (2,1,1)/4 = 5, 2.5, 2.5 -> remainders tie, lower rank wins: 5, 3, 2
    assert status_json(cluster.log_path)["iterations"][0]["tasks_per_rank"] == [5, 3, 2]
