"""The training state written only every checkpoint.state_every iterations, and replayed
exactly: a run killed (kill -9, every process) between two states, rerun, trains the
iterations since the last state again from their durable aggregates, never rolling them out
again, and reaches weights and optimizer state tensor-equal to those of a run never
interrupted. FSDP at two nodes, with the weights published as deltas."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from orchestrator.checkpoints import sharded
from orchestrator.phase_table import Phase
from orchestrator.protocol.layout import RunLayout
from tests.harness import rl_flags, run_local, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(500)]

SETTINGS = ["train.strategy=fsdp", "checkpoint.state_every=3", "publish.delta=true", "publish.full_every=10", "rl.lr=1e-4"]


def _state(layout: RunLayout, iteration: int) -> dict:
    """The training state of a checkpoint: its fp32 master weights and AdamW's moments."""
    out = {f"master/{n}": t for n, t in sharded.read_all(layout.checkpoint(iteration) / "master").items()}
    for f in sorted((layout.checkpoint(iteration) / "optimizer").glob("*.safetensors")):
        out |= {f"optimizer/{n}": t for n, t in load_file(f).items()}
    return out


def test_a_run_killed_between_two_states_replays_the_iterations_since_and_reaches_the_same_state(demo_data, cluster, tmp_path):
    reference = run_local(rl_flags(demo_data, tmp_path / "reference", num_nodes=2, weights="1,1", max_iterations=5, extra=SETTINGS),
                          timeout=400)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    expected = RunLayout(tmp_path / "reference")
    for i in range(1, 6):
        stats = json.loads((expected.checkpoint(i) / "train_stats.json").read_text())
        assert stats["state"] == (i in (3, 5)), (i, stats["state"])
        assert (expected.checkpoint(i) / "optimizer").is_dir() == (i in (3, 5))

    flags = rl_flags(demo_data, cluster.log_path, num_nodes=2, weights="1,1", max_iterations=5, extra=SETTINGS)
    procs = cluster.start_all(flags, n=2, env_for={0: {"ORCHESTRATOR_FAULT": f"hold@5:{int(Phase.TRAIN)}"}})
    wait_for(lambda: "fault injection: holding" in procs[0].output(), 300, "the master to reach iteration 5's training")
    cluster.kill_all()
    for p in procs:
        p.wait(timeout=30)
    layout = cluster.layout
    assert not (layout.checkpoint(4) / "optimizer").exists(), "iteration 4's checkpoint holds no state: the rerun must replay"
    rollouts = sorted(p.stat().st_mtime for p in layout.iteration(4).aggregate("train").parent.iterdir())

    rerun = cluster.start_all(flags, n=2)
    assert cluster.wait_all(rerun, timeout=300) == [0, 0], rerun[0].output()[-4000:]
    assert "replays iterations 4..4 from their aggregates, from iteration 3's state" in rerun[0].output()
    stats = json.loads((layout.checkpoint(5) / "train_stats.json").read_text())
    assert stats["policy_from"] == "replayed 4..4" and stats["replayed"] == [4, 4], stats
    shown = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={cluster.log_path}"], capture_output=True,
                           text=True, timeout=60)
    assert "iteration 5's trainer replayed iterations 4..4 from their aggregates" in " ".join(shown.stdout.split()), shown.stdout
    assert sorted(p.stat().st_mtime for p in layout.iteration(4).aggregate("train").parent.iterdir()) == rollouts, "nothing rolled out again"
    got, want = _state(layout, 5), _state(expected, 5)
    assert got.keys() == want.keys() and all(got[n].equal(want[n]) for n in want), \
        [n for n in want if not got[n].equal(want[n])][:5]
