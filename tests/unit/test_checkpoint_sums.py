"""A checkpoint's checksums are computed as its files are written (checkpoints/sums.py):
safetensors streamed by the writer read back by the safetensors package; sealing reads no
summed file back (strace counts the opens) and catches a file cut short; a reader verifies
only its part (the engines the weights, a trainer all of it); a manifest of an older run,
with sha256, still verifies."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from orchestrator.checkpoints import manifest, sums
from orchestrator.checkpoints.manifest import CheckpointCorrupt


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=g, dtype=torch.float32),
        "model.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "model.half": torch.randn(2, 3, generator=g).to(torch.float16),
        "step": torch.tensor(3.0),
        "ids": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
    }


def _checkpoint(directory, writers: int = 2):
    """A checkpoint as the trainer writes one: weights and optimizer state from ``writers``
    workers, summed; a config.json a library wrote (not summed)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "optimizer").mkdir()
    for w in range(writers):
        written = sums.Sums(directory, f"worker-{w}")
        written.save_safetensors(directory / f"model-{w}.safetensors", {f"w{w}": torch.full((256, 256), float(w))}, {"format": "pt"})
        written.save_safetensors(directory / "optimizer" / f"adamw-{w}.safetensors", {f"w{w}/exp_avg": torch.ones(64)})
        written.record()
    (directory / "config.json").write_text(json.dumps({"model_type": "demo"}))
    return directory


def test_a_streamed_safetensors_file_reads_back_equal_with_its_metadata_and_its_sum_is_the_file_s(tmp_path):
    tensors = _tensors()
    written = sums.Sums(tmp_path, "worker-0")
    written.save_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == tensors[k].dtype and back[k].equal(tensors[k]) for k in tensors)
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    entry = written.files["x.safetensors"]
    assert entry == {"bytes": (tmp_path / "x.safetensors").stat().st_size, "xxh3_128": sums.file_sum(tmp_path / "x.safetensors")}
    assert not list(tmp_path.glob(".*.tmp")), "the temp file is renamed into place"


def test_a_write_that_fails_leaves_no_file_and_no_sum(tmp_path):
    written = sums.Sums(tmp_path, "worker-0")
    with pytest.raises(ValueError, match="complex64"):
        written.save_safetensors(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    assert list(tmp_path.iterdir()) == [] and written.files == {}


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_sealing_opens_no_file_a_writer_summed_only_the_small_ones_a_library_wrote(tmp_path):
    directory = _checkpoint(tmp_path / "iter-1")
    trace = tmp_path / "trace"
    code = f"from orchestrator.checkpoints import manifest; manifest.seal(__import__('pathlib').Path({str(directory)!r}))"
    subprocess.run(["strace", "-f", "-e", "trace=open,openat", "-o", str(trace), sys.executable, "-c", code], check=True, timeout=120)
    opened = [line for line in trace.read_text().splitlines() if str(directory) in line and "ENOENT" not in line]
    assert not [line for line in opened if ".safetensors" in line], opened
    assert [line for line in opened if "config.json" in line]
    files = json.loads((directory / manifest.MANIFEST).read_text())["body"]["files"]
    assert sorted(files) == ["config.json", "model-0.safetensors", "model-1.safetensors", "optimizer/adamw-0.safetensors",
                             "optimizer/adamw-1.safetensors"]
    assert all(e["xxh3_128"] == sums.file_sum(directory / name) for name, e in files.items())
    assert not (directory / sums.DIRECTORY).exists(), "the writers' sums are gathered into the manifest"
    manifest.verify(directory)


def test_a_summed_file_cut_short_is_named_when_sealing(tmp_path):
    directory = _checkpoint(tmp_path / "iter-1")
    weights = directory / "model-1.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointCorrupt, match=r"model-1.safetensors has \d+ bytes where its writer wrote \d+"):
        manifest.seal(directory)


def test_each_reader_verifies_its_part_the_engines_the_weights_a_trainer_all(tmp_path):
    directory = _checkpoint(tmp_path / "iter-1")
    manifest.seal(directory)
    state = directory / "optimizer" / "adamw-0.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    manifest.verify(directory, manifest.WEIGHTS)  # what an engine reads is intact
    with pytest.raises(CheckpointCorrupt, match=r"adamw-0.safetensors is damaged \(xxh3_128"):
        manifest.verify(directory, manifest.ALL)
    weights = directory / "model-0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"model-0.safetensors is damaged"):
        manifest.verify(directory, manifest.WEIGHTS)


def test_a_manifest_of_an_older_run_with_sha256_still_verifies(tmp_path):
    directory = _checkpoint(tmp_path / "iter-1", writers=1)
    from orchestrator.protocol import fsio

    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in directory.rglob("*") if p.is_file() and ".sums" not in p.parts}
    fsio.write_record(directory / manifest.MANIFEST, {"files": files})
    manifest.verify(directory)
    (directory / "config.json").write_text("{}")
    with pytest.raises(CheckpointCorrupt, match="config.json is damaged"):
        manifest.verify(directory)
