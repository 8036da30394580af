"""Records and shards on disk: a bad or half file reads as "not yet"; shards resume and verify."""

import json

import pytest

from orchestrator.data import shards
from orchestrator.protocol import fsio


def test_record_round_trip_and_invalid_files_read_as_absent(tmp_path):
    p = tmp_path / "r.json"
    assert fsio.read_record(p) is None
    fsio.write_record(p, {"a": 1, "b": [1, 2]})
    assert fsio.read_record(p) == {"a": 1, "b": [1, 2]}
    data = p.read_bytes()
    p.write_bytes(data[: len(data.rstrip()) // 2])  # cut short, as sshfs can serve a replaced file
    assert fsio.read_record(p) is None
    p.write_bytes(data.replace(b'"a":1', b'"a":2'))  # parses, checksum wrong
    assert fsio.read_record(p) is None
    p.write_bytes(b"")
    assert fsio.read_record(p) is None


def test_a_small_record_keeps_its_size_as_its_values_change(tmp_path):
    """Padded to a power of two: a FUSE client that serves a replaced file cut to the size it
    cached (sshfs) still serves all of it, as a heartbeat's numbers change at every beat."""
    p = tmp_path / "hb.json"
    sizes = set()
    for k in (1, 9, 10, 99999, 100000):
        fsio.write_record(p, {"counter": k, "in_phase_s": k / 7, "state": "working" if k % 2 else "waiting"})
        sizes.add(p.stat().st_size)
    assert sizes == {512}
    data = p.read_bytes()
    assert fsio.parse_record(data[:400]) is not None  # what a stale size of 400 bytes serves of it


def test_exclusive_create_has_one_winner(tmp_path):
    p = tmp_path / "claims" / "gen-1"
    assert fsio.create_record_exclusive(p, {"who": 1})
    assert not fsio.create_record_exclusive(p, {"who": 2})
    assert fsio.read_record(p) == {"who": 1}


def test_atomic_write_leaves_no_temp_files(tmp_path):
    for i in range(5):
        fsio.write_record(tmp_path / "x.json", {"i": i})
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]


def _rec(i):
    return {"task_id": f"t{i}", "payload": "x" * 10}


def _sealed_shard(path, ids):
    with shards.ShardWriter(path) as w:
        for i in ids:
            w.append(_rec(i))
    shards.seal(path)
    return path


def test_shard_writer_resumes_after_a_torn_line_and_keeps_complete_records(tmp_path):
    path = tmp_path / "r00001.jsonl"
    with shards.ShardWriter(path) as w:
        for i in range(3):
            w.append(_rec(i))
    with open(path, "ab") as f:
        f.write(b'{"task_id": "t3", "pay')  # the crash cut a line
    w = shards.ShardWriter(path)
    assert w.task_ids == {"t0", "t1", "t2"}
    w.append(_rec(3))
    w.close()
    assert shards.read_task_ids(path) == ["t0", "t1", "t2", "t3"]
    m = shards.seal(path, rank=1)
    assert m.count == 4 and shards.sealed(path) == m


def test_merge_refuses_a_shard_that_does_not_match_its_manifest_naming_the_rank(tmp_path):
    a, b = _sealed_shard(tmp_path / "r00000.jsonl", [0, 1]), _sealed_shard(tmp_path / "r00001.jsonl", [2, 3])
    b.write_text(b.read_text().replace("t3", "t9"))  # same size, different bytes
    with pytest.raises(shards.ShardError, match=r"rank 1: shard .*r00001.jsonl does not match its manifest"):
        shards.merge([("rank 0", a), ("rank 1", b)], tmp_path / "agg.jsonl")
    assert not (tmp_path / "agg.jsonl").exists()


def test_merge_streams_shards_and_refuses_duplicates(tmp_path):
    a, b = _sealed_shard(tmp_path / "r00000.jsonl", [0, 1]), _sealed_shard(tmp_path / "r00001.jsonl", [1, 2])
    with pytest.raises(shards.ShardError, match="task t1 appears twice"):
        shards.merge([("rank 0", a), ("rank 1", b)], tmp_path / "agg.jsonl")
    b.unlink()
    _sealed_shard(b, [2])
    m = shards.merge([("rank 0", a), ("rank 1", b)], tmp_path / "agg.jsonl")
    assert m.count == 3 and m.extra["per_source"] == {"rank 0": 2, "rank 1": 1}
    assert [json.loads(l)["task_id"] for l in (tmp_path / "agg.jsonl").read_text().splitlines()] == ["t0", "t1", "t2"]


def test_merge_puts_records_in_the_plan_order_and_keeps_only_what_counts(tmp_path):
    """Stolen chunks leave a task's record in any rank's shard: the aggregate is the same
    bytes whoever did what (its manifest hashes the ordered file), and a record ``keep``
    refuses (a chunk done twice) is left out and counted."""
    a, b = _sealed_shard(tmp_path / "r00000.jsonl", [0, 3, 4]), _sealed_shard(tmp_path / "r00001.jsonl", [1, 2, 3])
    dest = tmp_path / "agg.jsonl"
    m = shards.merge([("rank 0", a), ("rank 1", b)], dest, lambda label, rec: not (label == "rank 1" and rec["task_id"] == "t3"),
                     lambda rec: int(rec["task_id"][1:]))
    assert [json.loads(l)["task_id"] for l in dest.read_text().splitlines()] == ["t0", "t1", "t2", "t3", "t4"]
    assert m.count == 5 and m.extra["dropped"] == 1 and shards.verify(dest, m)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agg.jsonl", "agg.manifest.json", "r00000.jsonl", "r00000.manifest.json",
                                                           "r00001.jsonl", "r00001.manifest.json"]


def test_merge_counts_samples_whose_reward_failed(tmp_path):
    records = [{"task_id": "t0", "samples": [{"reward": 1.0}, {"reward": 0.0, "reward_error": "KeyError: x"}]},
               {"task_id": "t1", "samples": [{"reward": 0.0, "reward_error": "KeyError: y"}]}]
    shard = tmp_path / "r00000.jsonl"
    shard.write_text("".join(json.dumps(r) + "\n" for r in records))
    shards.seal(shard, rank=0)
    m = shards.merge([("rank 0", shard)], tmp_path / "agg.jsonl")
    assert m.extra["trajectories"] == 3 and m.extra["reward_errors"] == 2
    assert m.extra["first_reward_error"] == {"task_id": "t0", "error": "KeyError: x"}
