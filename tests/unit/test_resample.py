"""rl.filter_groups' resample rounds (data/resample.py): which groups are informative, each
chunk's count from its owner, and the decision every rank takes alike from the files."""

from __future__ import annotations

from orchestrator.data import claims, resample, shards
from orchestrator.protocol.layout import IterationLayout


def _record(task: str, *rewards: float) -> dict:
    return {"task_id": task, "samples": [{"reward": r} for r in rewards]}


def test_a_group_is_informative_when_its_rewards_vary():
    assert resample.informative(_record("a", 0.0, 1.0))
    assert not resample.informative(_record("a", 1.0, 1.0))
    assert not resample.informative(_record("a", 0.5))
    assert not resample.informative({"task_id": "a"})  # a rehearsal record: no samples


def test_round_splits_draw_from_the_train_tasks():
    assert [resample.split_of(k) for k in range(3)] == ["train", "train-r1", "train-r2"]
    assert resample.is_round("train-r12") and not resample.is_round("train") and not resample.is_round("train-rx")
    assert resample.base("train-r2") == "train" and resample.base("eval") == "eval"
    plan = {"train": {"resample_rounds": 2}, "train-r1": {}, "train-r2": {}}
    assert resample.planned(plan) == ["train", "train-r1", "train-r2"]
    assert resample.planned({"train": {}}) == ["train"]


def _plan(total: int = 4) -> dict:
    split = {"enabled": True, **claims.plan_split(total, [1, 1], stealing=False, chunk_tasks=0, min_chunk_tasks=1)}
    return {"train": {**split, "resample_rounds": 1}, "train-r1": dict(split)}


IDS = {"train": ["a", "b", "c", "d"], "train-r1": ["e", "f", "g", "h"]}


def _finish(it: IterationLayout, split: str, rank: int, informative: int) -> None:
    """``rank`` claims its one chunk of ``split`` and notes it finished with ``informative`` groups."""
    chunk = next(c for c in claims.chunks_of(_plan()[split]) if c.rank == rank)
    assert claims.Ledger(it, split, rank, [chunk], stealing=False, settle_s=0.0, attempt="a1").claim(chunk) is claims.Outcome.WON
    claims.note_finished(it, split, rank, {chunk.index}, {chunk.index: informative})


def test_the_next_round_opens_only_once_every_chunk_is_finished_and_too_few_groups_are_informative(tmp_path):
    it, plan = IterationLayout(tmp_path), _plan()
    assert resample.next_round_opens(it, plan, 0, IDS.get) is None  # nothing claimed yet
    _finish(it, "train", 0, informative=1)
    assert resample.next_round_opens(it, plan, 0, IDS.get) is None  # rank 1's chunk is open
    _finish(it, "train", 1, informative=2)
    assert resample.informative_count(it, "train", plan["train"], IDS["train"]) == 3
    assert resample.next_round_opens(it, plan, 0, IDS.get) is True  # 3 of the 4 wanted
    assert resample.opened(it, plan, IDS.get).splits == ["train", "train-r1"]
    _finish(it, "train-r1", 0, informative=0)
    _finish(it, "train-r1", 1, informative=2)
    assert resample.next_round_opens(it, plan, 1, IDS.get) is False  # no round 2 planned
    assert resample.opened(it, plan, IDS.get).splits == ["train", "train-r1"]


def test_enough_informative_groups_in_the_first_round_open_no_other(tmp_path):
    it, plan = IterationLayout(tmp_path), _plan()
    _finish(it, "train", 0, informative=2)
    _finish(it, "train", 1, informative=2)
    assert resample.next_round_opens(it, plan, 0, IDS.get) is False
    assert resample.opened(it, plan, IDS.get).splits == ["train"]


def test_an_adopted_ranks_chunks_count_from_the_masters_copy_of_its_records(tmp_path):
    it, plan = IterationLayout(tmp_path), _plan()
    _finish(it, "train", 0, informative=1)
    # Rank 1 wrote two records and died: its claim was never made, so the master adopts it,
    # copying its records and moving its two undone tasks to a new chunk (done by rank 0 here).
    with shards.ShardWriter(it.shard("train", 1)) as w:
        w.append(_record("c", 0.0, 1.0))
    adopted, moved = claims.adopt(it, "train", plan["train"], IDS["train"], iteration=1, ranks=[1], weights=[1, 0], attempt="a2")
    assert adopted == [1] and moved == 1
    new = claims.Adoptions.read(it, "train").chunks[0]
    assert resample.informative_count(it, "train", plan["train"], IDS["train"]) is None  # the new chunk is open
    chunks = claims.all_chunks(it, "train", plan["train"])
    ledger = claims.Ledger(it, "train", 0, chunks, stealing=False, settle_s=0.0, attempt="a2", adoptions=claims.Adoptions.read(it, "train"))
    assert ledger.claim(new) is claims.Outcome.WON
    claims.note_finished(it, "train", 0, {0, new.index}, {0: 1, new.index: 0})
    assert resample.informative_count(it, "train", plan["train"], IDS["train"]) == 2  # 1 + "c" from the copy + 0
