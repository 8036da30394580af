"""The load a run puts on the shared filesystem while it does nothing but coordinate, counted
by strace (bench/opcount.py) over simulated ranks that run the protocol's own code
(bench/scale.py): at default settings a worker costs at most 2 metadata operations a second,
whether its phase's work runs or it waits at a barrier, and a barrier round costs a bounded
number of operations per rank."""

from __future__ import annotations

import os

import pytest

from bench import opcount, scale

WORKERS_OPS_PER_S = 2.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_at_default_settings_a_worker_costs_at_most_two_metadata_operations_a_second_working_or_waiting(tmp_path):
    if not opcount.available():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but strace is not installed (scripts/setup-dev.sh installs it)", pytrace=False)
        pytest.skip("strace is not installed")
    r = scale.run_one(8, base=tmp_path, window_s=9.0, rounds=6, per_process=3, trace=True, timeout_s=200, kill=False)
    for window in ("working", "waiting"):
        assert 0 < r[window]["per_worker_ops_per_s"] <= WORKERS_OPS_PER_S, (window, r)
    # the master's arrival polls are paced, its monitor reads one file a rank per heartbeat
    assert r["working"]["master_ops_per_s"] <= 250 + 10 * 8, r
    assert r["round_ops_per_rank"] <= 20, r
