"""The training state written only every checkpoint.state_every iterations, and replayed
exactly; the weights published as deltas and rebuilt on each node. One run is killed (kill -9,
every process) again and again, each time somewhere else: while a node rebuilds a version for
its engines, while a train worker writes its delta, between two states, and while a trainer
replays. Each rerun goes on from where the run was; at the end its weights and optimizer state
are tensor-equal to those of a run never interrupted, nothing was rolled out twice, and every
version any engine served had the bits the uninterrupted run published. FSDP at two nodes."""

import json
import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from orchestrator.checkpoints import sharded, store, sums
from orchestrator.checkpoints.node_copy import NodeCopies
from orchestrator.phase_table import Phase
from orchestrator.protocol.layout import RunLayout
from tests.harness import rl_flags, run_local, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SETTINGS = ["train.strategy=fsdp", "checkpoint.state_every=3", "publish.delta=true", "publish.full_every=10", "rl.lr=1e-4"]
ITERATIONS = 5


def _state(layout: RunLayout, iteration: int) -> dict:
    """The training state of a checkpoint: its fp32 master weights and AdamW's moments."""
    out = {f"master/{n}": t for n, t in sharded.read_all(layout.checkpoint(iteration) / "master").items()}
    for f in sorted((layout.checkpoint(iteration) / "optimizer").glob("*.safetensors")):
        out |= {f"optimizer/{n}": t for n, t in load_file(f).items()}
    return out


def _served(layout: RunLayout) -> list[tuple[int, str]]:
    """(iteration, sum of the weights) of every version an engine of the run loaded, from the engines' logs."""
    out = []
    for log in layout.root.glob("engines/*/engine*.log"):
        for found in re.finditer(r"loaded \S+/iter-(\d+) in .* xxh3_128 ([0-9a-f]+)\)", log.read_text(errors="replace")):
            if int(found[1]):  # not the base model, which the node copies as it is
                out.append((int(found[1]), found[2]))
    return out


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory):
    """The run never interrupted, and the sum of each version it published as a node rebuilds it."""
    log_path = tmp_path_factory.mktemp("reference") / "run"
    done = run_local(rl_flags(demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=ITERATIONS, extra=SETTINGS), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    layout = RunLayout(log_path)
    copies = NodeCopies(layout, log_path.parent / "cache")
    published = {i: sums.file_sum(copies.get(store.Checkpoint(layout.checkpoint(i), i)) / "model.safetensors")
                 for i in range(1, ITERATIONS + 1)}
    copies.close()
    return layout, published


def test_the_reference_run_writes_the_state_every_third_iteration_and_at_the_last_and_publishes_deltas(reference):
    layout, published = reference
    for i in range(1, ITERATIONS + 1):
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert stats["state"] == (i in (3, 5)) and (layout.checkpoint(i) / "optimizer").is_dir() == (i in (3, 5)), (i, stats)
        assert stats["published"] == ("full+delta" if i == 1 else "delta"), (i, stats["published"])
    assert {(i, s) for i, s in _served(layout)} <= set(published.items())


def test_a_run_killed_anywhere_in_publish_rebuild_and_replay_reaches_the_uninterrupted_state(demo_data, reference, cluster):
    expected, published = reference
    flags = rl_flags(demo_data, cluster.log_path, num_nodes=2, weights="1,1", max_iterations=ITERATIONS, extra=SETTINGS)
    layout = cluster.layout

    def killed_at(rank: int, fault: str, said, what: str) -> None:
        procs = cluster.start_all(flags, n=2, env_for={rank: {"ORCHESTRATOR_FAULT": fault}})
        wait_for(lambda: said(procs), 300, what)
        cluster.kill_all()
        for p in procs:
            p.wait(timeout=30)

    def trainer_says(text):
        return lambda procs: any(text in p.read_text(errors="replace") for p in layout.root.glob("attempts/*/train/trainer-w*.log"))

    killed_at(1, f"hold-in-rebuild@2:{int(Phase.ENGINE_RESTART)}", lambda procs: "fault injection: holding" in procs[1].output(),
              "rank 1 to hold in its rebuild of iteration 2's weights")
    assert (layout.checkpoint(2) / "delta.json").is_file()
    killed_at(0, f"hold-in-delta@4:{int(Phase.TRAIN)}", trainer_says("fault injection: holding at hold-in-delta of iteration 4"),
              "a train worker to hold with its delta of iteration 4 written")
    assert not layout.checkpoint(4).exists()
    killed_at(0, f"hold@5:{int(Phase.TRAIN)}", lambda procs: "fault injection: holding" in procs[0].output(),
              "the master to reach iteration 5's training")
    assert not (layout.checkpoint(4) / "optimizer").exists(), "iteration 4's checkpoint holds no state: the reruns must replay"
    rolled_out = sorted(p.stat().st_mtime for i in range(1, ITERATIONS + 1) for p in layout.iteration(i).aggregate("train").parent.iterdir())
    killed_at(0, f"hold-in-replay@5:{int(Phase.TRAIN)}", trainer_says("fault injection: holding at hold-in-replay of iteration 5"),
              "a trainer to hold in its replay")

    rerun = cluster.start_all(flags, n=2)
    assert cluster.wait_all(rerun, timeout=300) == [0, 0], rerun[0].output()[-4000:]
    assert "replays iterations 4..4 from their aggregates, from iteration 3's state" in rerun[0].output()
    stats = json.loads((layout.checkpoint(5) / "train_stats.json").read_text())
    assert stats["policy_from"] == "replayed 4..4" and stats["replayed"] == [4, 4], stats
    shown = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={cluster.log_path}"], capture_output=True,
                           text=True, timeout=60)
    assert "iteration 5's trainer replayed iterations 4..4 from their aggregates" in " ".join(shown.stdout.split()), shown.stdout
    assert sorted(p.stat().st_mtime for i in range(1, ITERATIONS + 1)
                  for p in layout.iteration(i).aggregate("train").parent.iterdir()) == rolled_out, "nothing rolled out again"
    got, want = _state(layout, ITERATIONS), _state(expected, ITERATIONS)
    assert got.keys() == want.keys() and all(got[n].equal(want[n]) for n in want), [n for n in want if not got[n].equal(want[n])][:5]
    served = _served(layout)
    assert {i for i, _ in served} >= {1, 2, 3, 4}, served
    assert set(served) <= set(published.items()), "an engine served a version whose bits the uninterrupted run did not publish"
