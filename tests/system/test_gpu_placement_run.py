"""Placement in a real run (issue 4): every node reports the GPUs it detects through the
shared filesystem; the master validates the cluster against the mappings before any work,
and each node runs the engines and train workers the placement gives it. ``nvidia-smi`` is
the one faked seam (tests/fake_gpus.py): this machine has no GPU."""

import re

import pytest

from orchestrator.protocol import fsio
from tests.fake_gpus import fake_nvidia_smi, gpu_env
from tests.harness import rl_flags, run_flags

pytestmark = pytest.mark.timeout(300)

MAPPING_8 = ["train.device_mapping=0-7", "rollout.device_mapping=0-7", "rollout.gpus_per_engine=2"]


def _nothing_worked(layout):
    return not layout.root.joinpath("iterations").exists() and fsio.read_record(layout.progress) is None


def test_nodes_whose_gpus_do_not_cover_the_mapping_are_refused(cluster, tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", extra=MAPPING_8)
    procs = cluster.start_all(flags, n=2, env_for={0: gpu_env(bin_dir, 4), 1: gpu_env(bin_dir, 2)})
    codes = cluster.wait_all(procs, timeout=60)
    master, worker = procs[0].output(), procs[1].output()
    assert codes == [2, 3], master + worker
    assert "train.device_mapping uses GPU 7, but 2 nodes of 4,2 GPUs have GPUs 0-5" in master, master
    assert re.search(r"node 0 \(\S+\): 4 GPU\(s\) \(nvidia-smi -L\); node 1 \(\S+\): 2 GPU\(s\)", master), master
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


def _real_loop_on_two_nodes_of_two_gpus(cluster, tmp_path, demo_data, weights, mappings):
    """One RL iteration on 2 ranks that each report 2 GPUs; both must exit 0."""
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    flags = rl_flags(demo_data, cluster.log_path, num_nodes=2, weights=weights, max_iterations=1, extra=mappings)
    procs = cluster.start_all(flags, n=2, env_for={r: gpu_env(bin_dir, 2) for r in (0, 1)})
    codes = cluster.wait_all(procs, timeout=240)
    assert codes == [0, 0], procs[0].output()[-3000:] + procs[1].output()[-3000:]
    return procs


@pytest.mark.slow
def test_each_node_runs_the_engines_and_train_workers_placed_on_it(cluster, tmp_path, demo_data):
    """2 nodes x 2 GPUs, colocated, one GPU per engine: four engines and four train workers,
    two of each per node, with node-local GPU ids and ports."""
    _real_loop_on_two_nodes_of_two_gpus(cluster, tmp_path, demo_data, "1,1",
                                        ["train.device_mapping=0-3", "rollout.device_mapping=0-3", "rollout.engine_port=18000"])
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
    assert any(layout.checkpoint(1).glob("model*.safetensors")), "the first version is written whole (by each train worker, its part)"
    manifest = fsio.read_record(layout.iteration(1).aggregate_manifest("train"))
    assert manifest["trajectories"] == 8 * 4  # rl.train_tasks x rl.samples_per_prompt


LAYOUTS = {
    # name: (GPUs each node reports, mappings, rehearsal.tasks=12 split by --rank-weights auto)
    "seed 003 disaggregated, 3 x 8: train 0-15, rollout 16-23": (
        (8, 8, 8), ["train.device_mapping=list(range(0,16))", "rollout.device_mapping=list(range(16,24))"], [0, 0, 12]),
    "seed 003 colocated, 2 x 8: train 0-15, rollout 0-11, 2 GPUs per engine": (
        (8, 8), ["train.device_mapping=list(range(0,16))", "rollout.device_mapping=list(range(0,12))", "rollout.gpus_per_engine=2"],
        [8, 4]),
    "train on node 0, inference on node 1": ((4, 4), ["train.device_mapping=0-3", "rollout.device_mapping=4-7"], [0, 12]),
    "one 8-GPU and two 4-GPU nodes": (
        (8, 4, 4), ["train.device_mapping=0-7", "rollout.device_mapping=8-15", "rollout.gpus_per_engine=2"], [0, 6, 6]),
}


@pytest.mark.parametrize("counts, mappings, split", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_disaggregated_and_uneven_layouts_plan_and_run_two_rehearsal_iterations(cluster, tmp_path, counts, mappings, split):
    """Nodes without engines take no rollout share; nodes without train workers wait through
    training; global GPU ranks count each node's own GPUs."""
    import json
    import os
    import subprocess
    import sys

    from tests.harness import status_json

    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    plan = subprocess.run([sys.executable, "-m", "orchestrator", "plan", f"--gpus-per-node={','.join(map(str, counts))}",
                           "--json", *mappings], capture_output=True, text=True, timeout=60, env=os.environ)
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["gpus_per_node"] == list(counts)
    assert [w for w in planned["rollout_weights"] if w == 0] == [0.0] * split.count(0)

    flags = run_flags(cluster.log_path, num_nodes=len(counts), weights="auto", max_iterations=2, eval_interval=1, extra=mappings)
    procs = cluster.start_all(flags, n=len(counts), env_for={r: gpu_env(bin_dir, c) for r, c in enumerate(counts)})
    assert cluster.wait_all(procs, timeout=90) == [0] * len(counts), "\n".join(p.output()[-2000:] for p in procs)
    status = status_json(cluster.log_path)
    assert [it["iteration"] for it in status["iterations"] if it["complete"]] == [1, 2]
    assert [it["tasks_per_rank"] for it in status["iterations"]] == [split, split]
    [attempt] = [p.name for p in cluster.layout.root.joinpath("attempts").iterdir()]
    placed = fsio.read_record(cluster.layout.attempt(attempt).start)["placement"]
    assert placed == {k: planned[k] for k in placed}, "the run placed what `plan` showed"


def test_weights_that_do_not_fit_the_engines_exit_2_naming_the_node(cluster, tmp_path):
    bin_dir = fake_nvidia_smi(tmp_path / "bin")
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", extra=["train.device_mapping=0-3", "rollout.device_mapping=4-7"])
    procs = cluster.start_all(flags, n=2, env_for={r: gpu_env(bin_dir, 4) for r in (0, 1)})
    codes = cluster.wait_all(procs, timeout=60)
    master = procs[0].output()
    assert codes == [2, 3], master
    assert re.search(r"--rank-weights gives node 0 \(\S+\) weight 1, but it runs no rollout engine", master), master
    assert _nothing_worked(cluster.layout)


@pytest.mark.slow
def test_the_real_loop_on_a_training_node_and_a_serving_node(cluster, tmp_path, demo_data):
    """2 nodes x 2 GPUs, train on node 0 (GPUs 0-1), engines on node 1 (GPUs 2-3), weights
    auto: node 1 rolls out and evaluates every task and serves on through training; node 0
    trains and writes the checkpoint."""
    from tests.harness import status_json

    procs = _real_loop_on_two_nodes_of_two_gpus(cluster, tmp_path, demo_data, "auto",
                                                ["train.device_mapping=0-1", "rollout.device_mapping=2-3", "rollout.engine_port=18100"])
    layout = cluster.layout
    assert not (layout.root / "engines" / "r00000").exists(), "node 0 runs no engine"
    assert sorted(p.name for p in (layout.root / "engines" / "r00001").glob("engine*.log")) == ["engine0.log", "engine1.log"]
    [it] = status_json(cluster.log_path)["iterations"]
    assert it["tasks_per_rank"] == [0, 8] and it["evaluated"]
    assert "disaggregated placement: the engines keep their GPUs and serve on through training" in procs[1].output()
    attempt = next(layout.root.joinpath("attempts").iterdir()).name
    assert [layout.attempt(attempt).trainer_log(w).is_file() for w in (0, 1)] == [True, True]
    assert any(layout.checkpoint(1).glob("model*.safetensors")), "the first version is written whole (by each train worker, its part)"
