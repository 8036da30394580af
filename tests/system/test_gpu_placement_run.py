"""Placement in a real run (issue 4): every node reports the GPUs it detects through the
shared filesystem; the master validates the cluster against the mappings before any work,
and each node runs the engines and train workers the placement gives it. ``nvidia-smi`` is
the one faked seam (tests/fake_gpus.py): this machine has no GPU."""

import re

import pytest

from orchestrator.protocol import fsio
from tests.fake_gpus import fake_nvidia_smi, gpu_env
from tests.harness import run_flags

pytestmark = pytest.mark.timeout(300)

MAPPING_8 = ["train.device_mapping=0-7", "rollout.device_mapping=0-7", "rollout.gpus_per_engine=2"]


def _nothing_worked(layout):
    return not layout.root.joinpath("iterations").exists() and fsio.read_record(layout.progress) is None


def test_nodes_with_other_gpu_counts_than_the_mapping_needs_are_refused(cluster, tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", extra=MAPPING_8)
    procs = cluster.start_all(flags, n=2, env_for={0: gpu_env(bin_dir, 4), 1: gpu_env(bin_dir, 2)})
    codes = cluster.wait_all(procs, timeout=60)
    master, worker = procs[0].output(), procs[1].output()
    assert codes == [2, 3], master + worker
    assert re.search(r"node 0 \(\S+\) 4, node 1 \(\S+\) 2", master), master
    assert "node 1" in worker and "GPU" in worker, worker
    assert _nothing_worked(cluster.layout)


def test_a_uniform_cluster_too_small_for_the_mapping_is_refused(cluster, tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", extra=MAPPING_8)
    procs = cluster.start_all(flags, n=2, env_for={r: gpu_env(bin_dir, 2) for r in (0, 1)})
    codes = cluster.wait_all(procs, timeout=60)
    master = procs[0].output()
    assert codes[0] == 2, master
    assert "uses GPU 7, but 2 node(s) x 2 GPUs per node have GPUs 0-3" in master
    assert re.search(r"node 0 \(\S+\): 2 GPU\(s\) \(nvidia-smi -L\); node 1 \(\S+\): 2 GPU\(s\)", master), master
    assert _nothing_worked(cluster.layout)


def test_cpu_nodes_given_a_gpu_mapping_are_refused(cluster):
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", extra=MAPPING_8)
    procs = cluster.start_all(flags, n=2, env_for={r: {"PATH": "/usr/bin:/bin"} for r in (0, 1)})
    codes = cluster.wait_all(procs, timeout=60)
    assert codes[0] == 2
    assert "needs GPUs, but the 2 node(s) have none" in procs[0].output()


@pytest.mark.slow
def test_each_node_runs_the_engines_and_train_workers_placed_on_it(cluster, tmp_path, demo_data):
    """2 nodes x 2 GPUs, colocated, one GPU per engine: four engines and four train workers,
    two of each per node, with node-local GPU ids and ports."""
    from tests.system.test_rl_loop import SMALL

    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    flags = [f"--data-path={demo_data}", f"--log-path={cluster.log_path}", "--rl-phase=both", "--eval-interval=1",
             "--num-nodes=2", "--rank-weights=1,1", "--max-iterations=1", *SMALL,
             "train.device_mapping=0-3", "rollout.device_mapping=0-3", "rollout.engine_port=18000"]
    procs = cluster.start_all(flags, n=2, env_for={r: gpu_env(bin_dir, 2) for r in (0, 1)})
    codes = cluster.wait_all(procs, timeout=240)
    assert codes == [0, 0], procs[0].output()[-3000:] + procs[1].output()[-3000:]
    layout = cluster.layout
    for rank, engines in ((0, (0, 1)), (1, (2, 3))):
        for local, engine in enumerate(engines):
            text = layout.engine_log(rank, engine).read_text()
            start = re.search(r"=== .* port (\d+), CUDA_VISIBLE_DEVICES=(\S*)", text)
            assert start, text[:500]
            assert start.group(2) == str(local)
            assert int(start.group(1)) >= 18000
    attempt = next(layout.root.joinpath("attempts").iterdir()).name
    for worker in range(4):
        assert layout.attempt(attempt).trainer_log(worker).is_file()
    assert layout.checkpoint(1).joinpath("model.safetensors").is_file()
    manifest = fsio.read_record(layout.iteration(1).aggregate_manifest("train"))
    assert manifest["trajectories"] == 8 * 4  # rl.train_tasks x rl.samples_per_prompt
