"""The quick preflight at the start of a run (issue 5): every rank puts doctor's quick facts
in its join record and the master warns about what differs, without stopping the run."""

import os

import pytest

from tests.harness import run_flags

pytestmark = pytest.mark.timeout(120)


def test_the_master_warns_about_a_version_that_differs_on_one_rank(cluster, tmp_path):
    fake = tmp_path / "fake-site"
    meta = fake / "vllm-9.9.9.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    planted = {"PYTHONPATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))}
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", max_iterations=1)
    procs = cluster.start_all(flags, n=2, env_for={1: planted})
    assert cluster.wait_all(procs, timeout=90) == [0, 0]
    warnings = [line for line in procs[0].output().splitlines() if "preflight:" in line]
    assert any("vllm" in line and "9.9.9" in line and "rank 1" in line for line in warnings), procs[0].output()[-3000:]


def test_a_consistent_cluster_gets_no_preflight_warning(cluster):
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", max_iterations=1)
    procs = cluster.start_all(flags, n=2)
    assert cluster.wait_all(procs, timeout=90) == [0, 0]
    assert "preflight:" not in procs[0].output()
