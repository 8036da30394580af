"""A completed run's master ends its log with one closing line (data/summary.py's
``closing``), a worker with `run complete` alone."""

import pytest

from tests.harness import run_flags, run_local

pytestmark = pytest.mark.timeout(120)


def test_the_master_closes_a_completed_run_with_its_iterations_eval_ends_and_where_to_look(tmp_path):
    log_path = tmp_path / "run"
    result = run_local(run_flags(log_path, num_nodes=2, weights="1,1", eval_interval=1, max_iterations=2), timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    closing = [line for line in result.stdout.splitlines() if "run complete" in line]
    assert len(closing) == 2, closing
    master, worker = sorted(closing, key=lambda line: "[rank 1]" in line)
    assert "[rank 0]" in master and "run complete: 2 iterations in " in master
    assert "simulated eval accuracy " in master and "at iteration 1, " in master and "at iteration 2;" in master
    assert f"see it with `orchestrator report --log-path {log_path}`" in master
    assert worker.endswith("run complete")
