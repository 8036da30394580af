"""Three ranks as separate processes walk the full protocol (issue 2, done-when 2)."""

import pytest

from tests.harness import aggregate_task_ids, run_flags, status_json

pytestmark = pytest.mark.timeout(90)


def test_three_rank_rehearsal_completes_with_weighted_split_and_eval_schedule(cluster):
    flags = run_flags(cluster.log_path)
    procs = cluster.start_all(flags)
    codes = cluster.wait_all(procs, timeout=60)
    assert codes == [0, 0, 0], "\n".join(p.output() for p in procs)

    status = status_json(cluster.log_path)
    assert status["num_nodes"] == 3
    assert status["rl_phase"] == "both"
    assert status["failure"] is None
    assert [r["rank"] for r in status["ranks"]] == [0, 1, 2]
    assert all(not r["alive"] and r["state"] == "done" for r in status["ranks"])
    its = status["iterations"]
    assert [it["iteration"] for it in its] == [1, 2, 3]
    assert [it["evaluated"] for it in its] == [True, False, True]
    # 12 tasks at weights 2:1:1 -> 6, 3, 3
    assert all(it["tasks_per_rank"] == [6, 3, 3] for it in its)
    assert all(it["trajectories"] == 12 for it in its)
    assert all("accuracy" in it["metrics"] for it in its if it["evaluated"])
    for i in (1, 2, 3):
        ids = aggregate_task_ids(cluster.layout, i)
        assert sorted(ids) == sorted(set(ids)) and len(ids) == 12


def test_largest_remainder_split_is_visible_in_status(cluster):
    flags = run_flags(cluster.log_path, max_iterations=1, extra=["rehearsal.tasks=10"])
    procs = cluster.start_all(flags)
    assert cluster.wait_all(procs, timeout=60) == [0, 0, 0], "\n".join(p.output() for p in procs)
    # 10 * (2,1,1)/4 = 5, 2.5, 2.5 -> remainders tie, lower rank wins: 5, 3, 2
    assert status_json(cluster.log_path)["iterations"][0]["tasks_per_rank"] == [5, 3, 2]
