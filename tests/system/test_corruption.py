"""Corrupted aggregate and checkpoint files (issue 6). A damaged aggregate is rebuilt from
the ranks' sealed shards before training reads it; a damaged checkpoint is refused, naming
the file, before any engine serves it or any trainer starts from it."""

import subprocess
import sys

import pytest

from orchestrator.data import shards
from orchestrator.protocol.layout import RunLayout
from tests.harness import assert_default_three_iteration_run, rl_flags, run_flags, wait_for


def _flip_a_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.timeout(120)
def test_a_damaged_aggregate_is_rebuilt_from_the_shards(cluster):
    flags = run_flags(cluster.log_path)
    procs = cluster.start_all(flags, env_for={0: {"ORCHESTRATOR_FAULT": "hold@2:8"}})
    wait_for(lambda: "fault injection: holding" in procs[0].output(), 60, "the master to reach phase 8 of iteration 2")
    cluster.kill_all()
    for p in procs:
        p.wait(timeout=30)
    aggregate = cluster.layout.iteration(2).aggregate("train")
    before = aggregate.read_bytes()
    _flip_a_byte(aggregate)
    assert not shards.verify(aggregate, shards.read_manifest(aggregate))
    rerun = cluster.start_all(flags)
    assert cluster.wait_all(rerun, timeout=90) == [0, 0, 0], rerun[0].output()[-3000:]
    assert "does not match its manifest; moved to" in rerun[0].output()
    assert aggregate.read_bytes() == before  # rebuilt byte for byte from the sealed shards
    assert len(list(aggregate.parent.glob("train.jsonl.damaged-*"))) == 1
    assert_default_three_iteration_run(cluster.log_path)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_damaged_checkpoint_is_refused_naming_the_file(demo_data, tmp_path):
    log_path = tmp_path / "run"
    layout = RunLayout(log_path)

    def run(iterations):
        return subprocess.run([sys.executable, "-m", "orchestrator", "run",
                               *rl_flags(demo_data, log_path, num_nodes=None, weights=None, max_iterations=iterations)],
                              capture_output=True, text=True, timeout=300)

    assert run(1).returncode == 0
    weights = layout.checkpoint(1) / "model.safetensors"
    good = weights.read_bytes()
    _flip_a_byte(weights)
    refused = run(2)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert f"checkpoint file {weights} is damaged (xxh3_128" in refused.stderr
    assert not layout.iteration(2).shard("train", 0).exists() or not layout.iteration(2).shard("train", 0).read_bytes()
    weights.write_bytes(good)  # restored from a copy, as the message says
    done = run(2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert shards.sealed(layout.iteration(2).aggregate("train")).count == 8
