"""Published weights as deltas (checkpoints/deltas.py) and their rebuild on a node
(checkpoints/node_copy.py), on checkpoints written as the trainer writes them (sharded.py) and
sealed as the run seals them: a delta rebuilds its version bit for bit; a node moves from the
version it holds by reading the new delta alone, and from the last full copy when it holds
none; a flipped byte or a deleted delta is caught, named, and the next way taken (the chain
from the full copy, then the version's master weights); with nothing left the error names the
file. Retention keeps the chain a kept version is rebuilt from."""

import json
import logging
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.checkpoints import deltas, retention, sharded, store, sums
from orchestrator.checkpoints.manifest import CheckpointCorrupt
from orchestrator.checkpoints.node_copy import NodeCopies
from orchestrator.protocol.layout import RunLayout


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(64, 32, generator=g))
        self.head = torch.nn.Parameter(torch.randn(32, 64, generator=g))
        self.norm = torch.nn.Parameter(torch.ones(32))


def _step(model, lr: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * lr)


def _publish(layout: RunLayout, model, iteration: int, base: dict | None, also_full: bool = False) -> bool:
    """Iteration ``iteration``'s checkpoint as the trainer writes it (bf16 weights, a delta
    against ``base`` where smaller, and whole too when ``also_full``), sealed and renamed into place."""
    staging = store.new_staging(layout, iteration, "a1", 0)
    written = sums.Sums(staging, "worker-0")
    delta = sharded.DeltaBase(base, iteration - 1, lambda d, f: d < f, also_full) if base is not None else None
    as_delta = sharded.save_whole(model, staging, written, dtype=torch.bfloat16, delta=delta)
    written.record()
    (staging / "config.json").write_text(json.dumps({"model_type": "toy", "dtype": "bfloat16"}))
    store.place(layout, iteration, staging)
    return as_delta


def _published(model) -> dict:
    return {n: t.detach().to(torch.bfloat16) for n, t in sharded.model_tensors(model)}


@pytest.fixture
def run(tmp_path):
    """Four versions: 1 whole, 2..4 deltas (3 whole too: publish.full_every), each at a small
    step; and the bf16 values of each."""
    layout = RunLayout(tmp_path / "run")
    layout.checkpoints.mkdir(parents=True)
    model, values, before = _Model(), {}, None
    for i in (1, 2, 3, 4):
        _step(model, 1e-3, i)
        assert _publish(layout, model, i, before, also_full=i == 3) == (before is not None)
        values[i] = before = _published(model)
    return layout, values


def _served(path) -> dict:
    return load_file(path / "model.safetensors")


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and a[n].equal(b[n]) for n in a)


def test_a_delta_rebuilds_its_version_bit_for_bit_and_is_small_after_a_small_step():
    model = _Model()
    base = _published(model)
    _step(model, 1e-4, 1)
    new = _published(model)
    encoded = deltas.encode(new, base)
    full = sum(t.numel() * t.element_size() for t in new.values())
    assert encoded.size < 0.6 * full
    assert all(frame.dtype == torch.uint8 for frame in encoded.frames.values())
    rebuilt = {}
    import zstandard
    import numpy as np
    for name, t in base.items():
        xor = np.frombuffer(zstandard.ZstdDecompressor().decompress(encoded.frames[name].numpy().tobytes()), dtype=np.uint8)
        rebuilt[name] = torch.from_numpy(np.bitwise_xor(t.reshape(-1).view(torch.uint8).numpy(), xor)).view(torch.bfloat16).reshape(t.shape)
        assert deltas.tensor_sum(rebuilt[name]) == encoded.tensors[name]["sum"]
    assert _equal(rebuilt, new)
    with pytest.raises(ValueError, match="no like base"):
        deltas.encode(new, {n: t.float() for n, t in base.items()})


def test_a_node_moves_by_the_new_delta_alone_and_rebuilds_from_the_full_copy_after_a_restart(run, tmp_path):
    layout, values = run
    assert not deltas.is_delta(layout.checkpoint(1)) and all(deltas.is_delta(layout.checkpoint(i)) for i in (2, 3, 4))
    assert [deltas.needs_base(layout.checkpoint(i)) for i in (1, 2, 3, 4)] == [False, True, False, True]
    assert json.loads((layout.checkpoint(3) / "orchestrator.manifest.json").read_text())["body"]["delta_base"] == 2
    copies = NodeCopies(layout, tmp_path / "cache")
    for i in (1, 2, 3):
        path = copies.get(store.Checkpoint(layout.checkpoint(i), i))
        assert _equal(_served(path), values[i])
        assert path.parent == copies.root and copies.root.parent == tmp_path / "cache" and (path / "config.json").is_file()
    delta_3 = sum(p.stat().st_size for p in layout.checkpoint(3).glob("delta*"))
    assert copies.last.how.startswith("from iteration 2, which it held")
    assert copies.last.bytes_read < delta_3 + 200, "the move read the new delta (and the config): not the full copy beside it"
    assert sorted(p.name for p in copies.root.iterdir()) == ["iter-3"], "the versions the engines left are removed"

    gone = subprocess.Popen(["true"])
    gone.wait()
    left = copies.root.rename(tmp_path / "cache" / f"p{gone.pid}-crashed")  # as a process that died left it
    restarted = NodeCopies(layout, tmp_path / "cache")
    assert not left.exists() and restarted.root.parent == tmp_path / "cache", "a copy a crash left is not trusted"
    path = restarted.get(store.Checkpoint(layout.checkpoint(4), 4))
    assert _equal(_served(path), values[4]) and restarted.last.how == "from the full copy of iteration 3 and 1 delta(s)"
    assert restarted.last.bytes_read < (layout.checkpoint(3) / "model.safetensors").stat().st_size + 2 * delta_3


@pytest.mark.parametrize("fault", ["flipped", "deleted"])
def test_a_damaged_or_missing_delta_is_named_and_the_next_way_taken_until_none_is_left(run, tmp_path, caplog, fault):
    layout, values = run
    victim = next(layout.checkpoint(2).glob("delta-*.safetensors"))
    if fault == "flipped":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    copies = NodeCopies(layout, tmp_path / "cache")
    copies.get(store.Checkpoint(layout.checkpoint(1), 1))
    with caplog.at_level(logging.WARNING):
        path = copies.get(store.Checkpoint(layout.checkpoint(2), 2))
    assert _equal(_served(path), values[2]) and copies.last.how == "from iteration 2's master weights"
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert str(victim) in warned and "from iteration 1, which it held" in warned and "from the full copy of iteration 1" in warned

    # Iteration 3 is a delta against 2: from the node's own copy of 2 the damage is never read.
    assert _equal(_served(copies.get(store.Checkpoint(layout.checkpoint(3), 3))), values[3])
    assert copies.last.how.startswith("from iteration 2, which it held")

    for part in (layout.checkpoint(2) / "master").iterdir():  # its training state gone (checkpoint.state_every): nothing left
        part.unlink()
    with pytest.raises(CheckpointCorrupt, match=str(victim)):
        NodeCopies(layout, tmp_path / "cache2").get(store.Checkpoint(layout.checkpoint(2), 2))


def test_retention_keeps_the_chain_a_kept_version_is_rebuilt_from():
    decision = retention.decide([1, 2, 3, 4, 5, 6], current=6, keep_last=2, keep_every=0, consumers={}, bases={2: 1, 3: 2, 5: 4, 6: 5})
    assert decision.remove == [1, 2, 3]
    assert decision.keep[4] == ["chain of 5", "chain of 6"] and decision.keep[5] == ["keep_last=2", "chain of 6"]
    everything = retention.decide([1, 2, 3], current=3, keep_last=1, keep_every=0, consumers={}, bases={2: 1, 3: 2})
    assert everything.remove == [] and everything.keep[1] == ["chain of 3"]


def test_retention_keeps_the_newest_state_a_trainer_replays_from():
    decision = retention.decide([3, 4, 5, 6, 7], current=7, keep_last=2, keep_every=0, consumers={}, states=[3, 6])
    assert decision.remove == [3, 4, 5] and decision.keep[6] == ["keep_last=2"]
    decision = retention.decide([3, 4, 5, 6, 7, 8], current=8, keep_last=2, keep_every=0, consumers={}, states=[3, 6, 8])
    assert decision.remove == [3, 4, 5, 6]
    decision = retention.decide([3, 4, 5, 6, 7, 8], current=8, keep_last=1, keep_every=0, consumers={}, states=[3, 6])
    assert decision.remove == [3, 4, 5, 7] and decision.keep[6] == ["state to replay from"]
