"""A training step whose peer becomes unreachable (issue 6): two ranks in their own network
namespaces, the link of rank 1's node cut in the middle of the GRPO step. The collective
times out within rl.train_timeout_s, the run stops naming a rank, phase 10 and the cause,
and once the link is back, re-running the same commands finishes the iteration."""

import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.data import shards
from orchestrator.protocol.layout import RunLayout
from tests.harness import rl_flags, status_json, wait_for
from tests.netns import namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
TRAIN_TIMEOUT_S = 10
NODE_TIMEOUT_S = 10


def _start(cluster, k, data, log_path, out_dir, attempt):
    flags = rl_flags(data, log_path, num_nodes=2, weights="1,1", max_iterations=1, extra=[
        f"coordination.node_timeout_s={NODE_TIMEOUT_S}", "rl.train_tasks=64", "rl.epochs=4", "rl.micro_batch=4",
        f"rl.train_timeout_s={TRAIN_TIMEOUT_S}"])
    argv = [sys.executable, "-m", "orchestrator", "run", *flags, "--master" if k == 0 else "--worker=1"]
    env = {**os.environ, "ORCHESTRATOR_HOST": f"node{k}", "MASTER_ADDR": cluster.address(0), "PYTHONUNBUFFERED": "1"}
    log = open(out_dir / f"rank{k}.{attempt}.log", "wb")
    return cluster.popen(k, argv, cwd=REPO, env=env, stdout=log, stderr=log), out_dir / f"rank{k}.{attempt}.log"


def test_link_cut_mid_training_times_out_names_the_rank_and_the_rerun_finishes(demo_data, tmp_path):
    log_path = tmp_path / "shared" / "run"
    layout = RunLayout(log_path)
    with namespaces(tmp_path, 2) as cluster:
        procs = [_start(cluster, k, demo_data, log_path, tmp_path, 1) for k in (0, 1)]
        trainer0 = None

        def training():
            nonlocal trainer0
            logs = list(log_path.glob("attempts/*/train/trainer-w00000.log"))
            return logs and "epoch 0 step 2/" in logs[0].read_text(errors="replace")

        wait_for(training, 240, "the GRPO step to be under way")
        cluster.set_link(1, False)
        cut = time.monotonic()
        codes = [p.wait(timeout=TRAIN_TIMEOUT_S + NODE_TIMEOUT_S + 60) for p, _ in procs]
        stopped = time.monotonic() - cut
        assert all(c != 0 for c in codes), codes
        assert 0 < stopped < TRAIN_TIMEOUT_S + NODE_TIMEOUT_S + 30
        failure = status_json(log_path)["failure"]
        assert failure["phase"] == "10:train" and failure["iteration"] == 1 and failure["rank"] in (0, 1), failure
        assert "train worker" in failure["error"] and "exited with code" in failure["error"], failure
        assert not layout.checkpoint(1).exists()
        print(f"link cut: the run stopped {stopped:.1f} s after the cut (rl.train_timeout_s={TRAIN_TIMEOUT_S})")

        cluster.set_link(1, True)
        again = [_start(cluster, k, demo_data, log_path, tmp_path, 2) for k in (0, 1)]
        codes = [p.wait(timeout=300) for p, _ in again]
        assert codes == [0, 0], again[0][1].read_text()[-3000:] + again[1][1].read_text()[-3000:]
    assert any(layout.checkpoint(1).glob("model*.safetensors")), "the first version is written whole (by each train worker, its part)"
    assert shards.sealed(layout.iteration(1).aggregate("train")).count == 64
