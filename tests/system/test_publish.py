"""A bf16 base through the real loop (publish.dtype=auto): the engines read bf16 weights, half
the bytes of the fp32 master, which the checkpoint keeps in master/ for the trainer alone; a
trainer that loads each checkpoint (train.keep_alive=false) continues from that master and
reaches the weights of one that continued in memory, tensor for tensor."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrator import checkpoints
from orchestrator.checkpoints import sharded
from orchestrator.protocol.layout import RunLayout
from tests.faultfs_fixtures import faultfs_mounts  # noqa: F401
from tests.harness import Cluster, rebuilt_sum, rl_flags, run_local, status_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def bf16_model(demo_data, tmp_path_factory):
    """The demo data's model saved in bf16, as released models are."""
    out = tmp_path_factory.mktemp("bf16") / "model"
    model = AutoModelForCausalLM.from_pretrained(demo_data / "model", dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(demo_data / "model").save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


def _run(demo_data, bf16_model, log_path, *extra):
    """Whole bf16 weights and the state in every checkpoint: the deltas are the next test's."""
    result = run_local(rl_flags(demo_data, log_path, num_nodes=1, weights="1", max_iterations=2,
                                extra=[f"model.path={bf16_model}", "rl.lr=1e-5", "publish.delta=false", "checkpoint.state_every=1",
                                       *extra]), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return RunLayout(log_path)


def test_a_bf16_base_publishes_bf16_weights_and_continues_from_the_fp32_master(demo_data, bf16_model, tmp_path):
    warm = _run(demo_data, bf16_model, tmp_path / "warm")
    cold = _run(demo_data, bf16_model, tmp_path / "cold", "train.keep_alive=false")
    for layout in (warm, cold):
        for i in (1, 2):
            out = layout.checkpoint(i)
            stats = json.loads((out / "train_stats.json").read_text())
            assert (stats["served_dtype"], stats["published_dtype"], stats["master_dtype"]) == ("bfloat16", "bfloat16", "float32")
            published, master = load_file(out / "model.safetensors"), load_file(out / "master" / "model.safetensors")
            assert all(published[n].equal(t.to(torch.bfloat16)) for n, t in master.items())
            assert checkpoints.weight_bytes(out) < 0.51 * (out / "master" / "model.safetensors").stat().st_size
            files = json.loads((out / checkpoints.MANIFEST).read_text())["body"]["files"]
            assert "master/model.safetensors" in files, "the master is sealed with the rest"
    moved = status_json(tmp_path / "warm")["iterations"][1]["timing"]["bytes"]
    state = sum(p.stat().st_size for d in ("master", "optimizer") for p in (warm.checkpoint(2) / d).iterdir())
    assert moved["written_state"] == state and moved["written"] == moved["written_weights"] + state, moved
    first = status_json(tmp_path / "warm")["iterations"][0]["timing"]["bytes"]
    read = checkpoints.weight_bytes(bf16_model) + checkpoints.weight_bytes(warm.checkpoint(1))  # a start, then a reload of bf16 weights
    assert (first["read"], first["read_per_node"]) == (read, {"0": read}), first
    assert json.loads((cold.checkpoint(2) / "train_stats.json").read_text())["policy_from"] == "checkpoint"
    assert json.loads((warm.checkpoint(2) / "train_stats.json").read_text())["policy_from"] == "memory"
    a, b = (load_file(layout.checkpoint(2) / "master" / "model.safetensors") for layout in (warm, cold))
    assert a.keys() == b.keys() and all(a[n].equal(b[n]) for n in a), "continued from the checkpoint's master, not its bf16 weights"
    moved = [n for n in a if not a[n].equal(load_file(warm.checkpoint(1) / "master" / "model.safetensors")[n])]
    assert moved, "iteration 2 trained"

    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={tmp_path / 'warm'}", f"--out={out}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fp32 master weights" in done.stdout, done.stdout + done.stderr
    exported = load_file(out / "model.safetensors")
    assert all(exported[n].dtype == torch.float32 and exported[n].equal(a[n]) for n in a), "export is in full precision"
    assert not (out / "master").exists() and (out / "tokenizer.json").is_file()


def _served_sums(layout: RunLayout, rank: int) -> dict[int, str]:
    """Iteration -> the sum of the weights rank ``rank``'s engine reported loading for it."""
    out = {}
    for line in next(layout.engine_dir(rank).glob("engine*.log")).read_text().splitlines():
        found = re.search(r"reloaded \S+/iter-(\d+) in place .* xxh3_128 ([0-9a-f]+)\)", line)
        if found:
            out[int(found[1])] = found[2]
    return out


def _expected_sum(layout: RunLayout, iteration: int, tmp_path) -> str:
    """The sum of the file a node writes for ``iteration``: its master weights cast to bf16."""
    return rebuilt_sum(layout.checkpoint(iteration), tmp_path / "expected", torch.bfloat16)


def test_weights_published_as_deltas_reach_every_engine_bit_for_bit(demo_data, bf16_model, tmp_path):
    """publish.delta, ddp at two nodes (each worker writes its part of each delta): versions 2
    and 4 as deltas, 1 and 3 whole and as deltas besides (the first against the bf16 base;
    publish.full_every=3); every engine serves each version's master cast to bf16, bit for
    bit; a move reads the delta alone; export gives the master, or, its state gone, the
    version rebuilt from its chain. (FSDP's deltas: test_replay.py.)"""
    nodes = 2
    result = run_local(rl_flags(demo_data, tmp_path / "run", num_nodes=nodes, weights="1,1", max_iterations=4,
                                extra=[f"model.path={bf16_model}", "rl.lr=1e-5", "publish.delta=true", "publish.full_every=3",
                                       "checkpoint.state_every=1",  # each version's master, to check what was served against
                                       f"rollout.local_cache={tmp_path / 'cache'}"]), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    layout = RunLayout(tmp_path / "run")
    for i, published in ((1, "full+delta"), (2, "delta"), (3, "full+delta"), (4, "delta")):
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert stats["published"] == published and stats["delta_base"] == i - 1, stats
        names = [p.name for p in layout.checkpoint(i).glob("*.safetensors")]
        assert len([n for n in names if n.startswith("delta-")]) == nodes, names
        assert len([n for n in names if n.startswith("model")]) == (nodes if "full" in published else 0), names
        assert json.loads((layout.checkpoint(i) / checkpoints.MANIFEST).read_text())["body"].get("delta_base") == i - 1
    for rank in range(nodes):
        served = _served_sums(layout, rank)
        assert served == {i: _expected_sum(layout, i, tmp_path) for i in (1, 2, 3)}, "every engine served each master, cast, exactly"
    moved = status_json(tmp_path / "run")["iterations"][1]["timing"]["bytes"]
    index = (layout.checkpoint(2) / "delta.json").stat().st_size
    delta = sum(p.stat().st_size for p in layout.checkpoint(2).glob("delta-*"))
    # the delta and its index; the configs and tokenizer, unchanged, come from the version the node holds
    assert moved["read_per_node"] == {str(r): delta + index for r in range(nodes)}, (moved, delta, index)
    assert not any((tmp_path / "cache").iterdir()), "the node-local copies go with the run"

    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={tmp_path / 'run'}", f"--out={out}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "fp32 master weights" in done.stdout, done.stdout + done.stderr
    master = sharded.read_all(layout.checkpoint(4) / "master")
    assert not (out / "delta.json").exists() and sharded.read_all(out).keys() == master.keys()
    shutil.rmtree(layout.checkpoint(4) / "master")
    done = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={tmp_path / 'run'}", f"--out={tmp_path / 'bf16'}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "rebuilt from its chain of deltas" in done.stdout, done.stdout + done.stderr
    exported = sharded.read_all(tmp_path / "bf16")
    assert all(exported[n].equal(t.to(torch.bfloat16)) for n, t in master.items())


@pytest.fixture
def two_mounts(faultfs_mounts, tmp_path):
    """Two faultfs mounts of one directory (two clients, each counting what it reads) and a
    Cluster; the ranks are killed before the mounts are torn down."""
    backing, mounts = faultfs_mounts(2)
    logs = tmp_path / "rank-logs"
    logs.mkdir()
    cluster = Cluster(tmp=logs, log_path=backing / "run")
    yield cluster, backing, mounts
    cluster.end()


def test_no_file_is_read_back_by_its_writer_and_an_engine_node_reads_the_deltas_alone(demo_data, bf16_model, two_mounts):
    """Rank 0 trains and serves no engine, rank 1 serves and does not train, each through its
    own mount, which counts every byte read: rank 0 (the writer, the node that seals, a rank
    that moves no engine) reads no weights or state back; rank 1 reads each version's delta
    once and no whole weights (its first copy is the base model, from model.path)."""
    cluster, backing, mounts = two_mounts
    extra = [f"model.path={bf16_model}", "rl.lr=1e-5", "publish.delta=true", "train.nodes=0", "rollout.nodes=1",
             f"rollout.local_cache={cluster.tmp / 'cache'}"]
    procs = [cluster.start(rank, rl_flags(demo_data, mounts[rank].path / "run", num_nodes=2, weights="0,1", max_iterations=3,
                                          extra=extra)) for rank in range(2)]
    codes = cluster.wait_all(procs, timeout=300)
    assert codes == [0, 0], "\n".join(f"--- rank {p.rank} ---\n{p.output()[-4000:]}" for p in procs)
    layout = RunLayout(backing / "run")
    (backing / "marker").write_bytes(b"x")
    for m in mounts:  # a read after the ranks' last: once the stats count it, they count every read before it
        (m.path / "marker").read_bytes()
    stats = [m.wait_stats(lambda s: "marker" in s.get("read_bytes", {})) for m in mounts]
    under = layout.checkpoints.relative_to(backing).as_posix() + "/"
    read = [{path: n for path, n in s["read_bytes"].items() if path.startswith(under)} for s in stats]
    tensors_read_by_writer = {p: n for p, n in read[0].items() if p.endswith(".safetensors")}
    assert tensors_read_by_writer == {}, f"the writer read weights or state back: {tensors_read_by_writer}"
    checkpoint_bytes = sum(f.stat().st_size for i in (1, 2, 3) for f in layout.checkpoint(i).rglob("*") if f.is_file())
    assert all(p.endswith(".json") for p in read[0]) and sum(read[0].values()) < 3 * 64 * 1024, \
        f"beyond the small files (configs, indexes, the writers' sums), the writer read {read[0]}"
    served = {p: n for p, n in read[1].items() if p.endswith(".safetensors")}
    deltas = {f.relative_to(backing).as_posix(): f.stat().st_size for i in (1, 2) for f in layout.checkpoint(i).glob("delta-*")}
    assert served.keys() == deltas.keys(), f"rank 1 read {sorted(served)}, where the deltas of iterations 1 and 2 are {sorted(deltas)}"
    assert all(served[p] <= deltas[p] + 65536 for p in deltas), (served, deltas)
    unchanged = [p for p in read[1] if "iter-000002/" in p and p.rsplit("/", 1)[1] in ("tokenizer.json", "config.json")]
    assert not unchanged, f"files the node holds already were read again: {unchanged}"
    print(f"rank 0 read {sum(read[0].values())} bytes of {checkpoint_bytes} under checkpoints/; rank 1 read {served}")
