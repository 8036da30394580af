"""Partial rollouts' carried groups (data/carry.py): the pool and each rank's share, a carried
sample continued, and the aggregate's split of a pool into the trained groups and the carried
ones, exactly once, with the staleness bound."""

from __future__ import annotations

import json
import math

import pytest

from orchestrator.data import carry, shards


@pytest.mark.parametrize("tasks,oversample", [(384, 0.25), (8, 0.5), (7, 0.3), (100, 1.0), (3, 0.1)])
def test_the_ranks_targets_add_up_to_at_least_the_trained_groups_however_the_pool_is_split(tasks, oversample):
    pool = carry.pool(tasks, oversample)
    assert pool == math.ceil(tasks * (1 + oversample) - 1e-9)
    for parts in ([pool], [pool // 2, pool - pool // 2], [1] * pool, [pool - 3, 1, 2] if pool > 3 else [pool]):
        assert sum(carry.target(p, oversample) for p in parts) >= tasks
        assert all(carry.target(p, oversample) <= p for p in parts)


def _record(task_id, samples, *, unfinished=False, carried=0, policy=0, iteration=1):
    r = {"task_id": task_id, "iteration": iteration, "policy_iteration": policy, "prompt_token_ids": [1, 2], "samples": samples}
    return r | ({"unfinished": True} if unfinished else {}) | ({"carried": carried} if carried else {})


def _done(n):
    return {"text": "x" * n, "token_ids": [5] * n, "logprobs": [-0.5] * n, "finish_reason": "stop", "reward": 1.0}


def _cut(n):
    return {"text": "y" * n, "token_ids": [7] * n, "logprobs": [-0.1] * n, "finish_reason": carry.ABORTED}


def test_a_continued_sample_keeps_its_tokens_and_logprobs_and_names_each_tokens_policy():
    record = carry.with_versions(_record("t", [_cut(3), _done(2)], unfinished=True, policy=4))
    assert record["samples"][0]["policy_versions"] == [[4, 3]] and record["samples"][1]["policy_versions"] == [[4, 2]]
    more = {"text": "zz", "token_ids": [9, 9], "logprobs": [-2.0, -3.0], "finish_reason": "length"}
    s = carry.continued(record["samples"][0], more, 5)
    assert s["token_ids"] == [7, 7, 7, 9, 9] and s["logprobs"] == [-0.1] * 3 + [-2.0, -3.0] and s["text"] == "yyyzz"
    assert s["policy_versions"] == [[4, 3], [5, 2]] and s["finish_reason"] == "length"
    assert carry.continued(s, {**more, "token_ids": [1], "logprobs": [0.0]}, 5)["policy_versions"] == [[4, 3], [5, 3]]
    done = carry.with_versions({**record, "samples": [s, record["samples"][1]], "policy_iteration": 5})
    assert done["policy_iteration"] == 4  # the oldest token's: what the staleness check reads
    assert sorted(carry.token_ages(done, 6)) == [(0, 2), (1, 2), (1, 3)]


def _write(path, records):
    with shards.ShardWriter(path) as w:
        for r in records:
            w.append(r)
    shards.seal(path)


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_split_trains_the_first_complete_groups_in_order_and_carries_the_rest_once(tmp_path):
    pool = tmp_path / "pool.jsonl"
    _write(pool, [
        _record("old", [_done(2), _done(3)], carried=1),  # carried in, finished now
        _record("a", [_done(1), _cut(2)], unfinished=True, policy=1, iteration=2),
        _record("b", [_done(1), _done(1)], policy=1, iteration=2),
        _record("c", [], unfinished=True, policy=1, iteration=2),  # never sent
        _record("d", [_done(4), _done(1)], policy=1, iteration=2),  # complete, beyond the trained ones
    ])
    m, split = carry.split(pool, tmp_path / "train.jsonl", tmp_path / "carry.jsonl", trained=2, iteration=2, bound=1, max_carry=1)
    assert [r["task_id"] for r in _read(tmp_path / "train.jsonl")] == ["old", "b"] and m.count == 2
    assert shards.sealed(tmp_path / "train.jsonl") and shards.sealed(tmp_path / "carry.jsonl")
    carried = {r["task_id"]: r for r in carry.read(tmp_path / "carry.jsonl")}
    assert list(carried) == ["a", "c", "d"]
    assert carried["a"]["carried"] == 1 and carried["a"]["origin_iteration"] == 2
    assert carried["a"]["samples"][1]["policy_versions"] == [[1, 2]]
    assert carried["c"]["carried"] == 0  # nothing sampled: a new task again, never past the bound
    assert split.summary() == {"trained": 2, "carried_in": 1, "carried_out": 3, "unfinished_samples": 1, "dropped": 0,
                               "tokens_dropped": 0, "token_age_max": 1, "token_age_mean": 5 / 7}  # old's 5 tokens 1 behind
    # Made again (a resumed aggregate phase): the same bytes, not appended twice.
    before = (tmp_path / "carry.jsonl").read_bytes()
    carry.split(pool, tmp_path / "train.jsonl", tmp_path / "carry.jsonl", trained=2, iteration=2, bound=1, max_carry=1)
    assert (tmp_path / "carry.jsonl").read_bytes() == before


def test_a_group_past_the_staleness_bound_is_dropped_and_counted_never_trained_or_carried(tmp_path):
    pool = tmp_path / "pool.jsonl"
    _write(pool, [
        _record("stale", [_done(3), _done(2)], carried=1, policy=0),  # tokens of checkpoint 0, trained by update 4
        _record("twice", [_done(1), _cut(2)], unfinished=True, carried=1, policy=2),  # may not be carried again
        _record("ok", [_done(1), _done(1)], policy=2),
    ])
    _m, split = carry.split(pool, tmp_path / "train.jsonl", tmp_path / "carry.jsonl", trained=2, iteration=4, bound=2, max_carry=1)
    assert [r["task_id"] for r in _read(tmp_path / "train.jsonl")] == ["ok"]
    assert carry.read(tmp_path / "carry.jsonl") == []
    assert split.dropped == 2 and split.dropped_ids == ["stale", "twice"] and split.tokens_dropped == 5 + 3
    assert split.age_max == 1


def test_the_carry_aggregate_is_read_once_there_and_a_torn_one_is_refused(tmp_path):
    path = tmp_path / "carry.jsonl"
    assert carry.read(path) is None  # not there (yet)
    carry.ensure(path, 1)
    assert carry.read(path) == []  # made empty by the master: nothing carried
    path.unlink()
    shards.manifest_path(path).unlink()
    _write(path, [_record("a", [_cut(2)], unfinished=True)])
    path.write_bytes(path.read_bytes().replace(b'"a"', b'"b"'))
    with pytest.raises(shards.ShardError, match="do not match their manifest"):
        carry.read(path)


def test_the_counts_reach_the_summary_and_the_trackers(tmp_path):
    from orchestrator.data import summary
    from orchestrator.protocol.layout import RunLayout
    from orchestrator.tracking.metrics import iteration_metrics

    counts = carry.Split(trained=12, carried_in=3, carried_out=6, unfinished_samples=5, dropped=1, tokens_dropped=40,
                         tokens_trained=100, age_max=1, age_tokens=25).summary()
    layout = RunLayout(tmp_path / "run")
    summary.update(layout, 2, complete=True, partial=counts)
    tracked = iteration_metrics(layout, 2)
    assert (tracked["rollout/carried_groups"], tracked["rollout/carried_in_groups"], tracked["rollout/dropped_groups"],
            tracked["rollout/dropped_tokens"], tracked["rollout/token_age_max"], tracked["rollout/token_age_mean"]) == (6, 3, 1, 40, 1, 0.25)
