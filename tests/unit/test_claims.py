"""Chunks and claims (data/claims.py): the plan's cut, exclusive claims raced by real processes,
void claims, and the owner rule the aggregate keeps records by."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from orchestrator.data import claims
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import IterationLayout


def test_the_plan_cuts_each_first_share_into_chunks_that_cover_every_task_once():
    plan = claims.plan_split(50, [2, 1, 1], stealing=True, chunk_tasks=0, min_chunk_tasks=1)
    assert plan["per_rank"] == [25, 13, 12] and plan["ranks"] == [0, 1, 2]
    assert plan["chunk_tasks"] == 1  # 50 tasks over 3 ranks x 32 chunks
    chunks = claims.chunks_of(plan)
    assert [t for c in chunks for t in c.tasks] == list(range(50))
    for r, n in enumerate(plan["per_rank"]):
        assert sum(c.size for c in chunks if c.rank == r) == n
        assert all(c.size == 1 for c in chunks)


def test_without_stealing_or_with_one_rank_a_share_is_one_chunk():
    static = claims.plan_split(12, [2, 1, 1], stealing=False, chunk_tasks=0, min_chunk_tasks=1)
    assert [(c.tasks, c.rank) for c in claims.chunks_of(static)] == [(tuple(range(0, 6)), 0), (tuple(range(6, 9)), 1), (tuple(range(9, 12)), 2)]
    alone = claims.plan_split(12, [1, 0, 0], stealing=True, chunk_tasks=0, min_chunk_tasks=1)
    assert [(c.tasks, c.rank) for c in claims.chunks_of(alone)] == [(tuple(range(12)), 0)]


def test_chunk_size_respects_the_workload_minimum_and_the_config():
    assert claims.plan_split(64, [1, 1], stealing=True, chunk_tasks=0, min_chunk_tasks=16)["chunk_tasks"] == 16
    assert claims.plan_split(64, [1, 1], stealing=True, chunk_tasks=5, min_chunk_tasks=16)["chunk_tasks"] == 5
    assert claims.plan_split(0, [1, 1], stealing=True, chunk_tasks=0, min_chunk_tasks=1)["chunks"] == []


def test_a_plan_written_before_chunks_reads_as_one_chunk_per_share():
    old = {"enabled": True, "total": 12, "per_rank": [6, 3, 3]}
    assert [(c.tasks, c.rank) for c in claims.chunks_of(old)] == [(tuple(range(0, 6)), 0), (tuple(range(6, 9)), 1), (tuple(range(9, 12)), 2)]


def _ledger(root: Path, rank: int, chunks, *, stealing: bool = True, settle_s: float = 5.0) -> claims.Ledger:
    return claims.Ledger(IterationLayout(root), "train", rank, chunks, stealing=stealing, settle_s=settle_s, attempt="a")


def _take_all(root: str, rank: int, per_rank: list[int], start_at: float, out) -> None:
    chunks = claims.cut(per_rank, 1)
    ledger = _ledger(Path(root), rank, chunks)
    while time.time() < start_at:
        pass
    taken = []
    while True:
        chunk, pending = ledger.take()
        if chunk is None and not pending:
            break
        if chunk is not None:
            taken.append(chunk.index)
    out.put((rank, taken))


def test_ranks_racing_for_chunks_take_each_exactly_once_and_a_rank_without_own_work_steals(tmp_path):
    per_rank = [20, 20, 20, 0]  # rank 3 has no first share: all it does, it steals
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0
    procs = [ctx.Process(target=_take_all, args=(str(tmp_path), r, per_rank, start_at, out)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    taken = [k for r in range(4) for k in results[r]]
    assert sorted(taken) == list(range(60)), "every chunk taken exactly once"
    owners = claims.owners(IterationLayout(tmp_path), "train", claims.cut(per_rank, 1))
    assert all(owners[k] == r for r in range(4) for k in results[r])


def test_without_stealing_a_rank_takes_exactly_its_own_chunks(tmp_path):
    chunks = claims.cut([2, 2], 1)
    ledger = _ledger(tmp_path, 1, chunks, stealing=False)
    got = [ledger.take()[0].index, ledger.take()[0].index, ledger.take()]
    assert got == [2, 3, (None, False)]


def test_a_thief_takes_from_the_back_of_the_rank_with_most_left(tmp_path):
    chunks = claims.cut([2, 5, 3], 1)
    thief = _ledger(tmp_path, 0, chunks)
    assert [thief.take()[0].index for _ in range(2)] == [0, 1]  # its own, front to back
    assert thief.take()[0].index == 6  # rank 1's last: it has the most left
    assert thief.expected() == 3


def test_a_thief_finds_the_unclaimed_run_of_a_share_by_bisection_reading_few_claims(tmp_path, monkeypatch):
    chunks = claims.cut([0, 64, 0, 0], 1)  # rank 1's share: chunks 0..63
    owner, other = _ledger(tmp_path, 1, chunks), _ledger(tmp_path, 2, chunks)
    assert [owner.take()[0].index for _ in range(20)] == list(range(20))  # its rank, from the front
    assert [other.take()[0].index for _ in range(10)] == list(range(63, 53, -1))  # a thief, from the back
    reads = []
    monkeypatch.setattr(fsio, "read_bytes", lambda path, real=fsio.read_bytes: reads.append(path) or real(path))
    thief = _ledger(tmp_path, 3, chunks)
    assert thief.take()[0].index == 53
    assert len(reads) <= 2 * 7 + 1, "each end of the run of 34 unclaimed chunks found in at most 7 reads"  # it was 65
    reads.clear()
    assert thief.take()[0].index == 52
    assert len(reads) <= 2 * 7 + 1


def test_a_thief_gives_up_after_enough_spent_shares_and_their_own_ranks_take_what_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "STEAL_PROBES", 1)
    monkeypatch.setattr(claims, "VICTIMS_PER_STEAL", 1)
    chunks = claims.cut([1, 2, 2, 2], 1)
    thief = _ledger(tmp_path, 0, chunks)
    first, *rest = [thief._shares[s][0].rank for s in thief._order]  # the order it looks at the others in
    for rank in [first, rest[0]]:
        owner = _ledger(tmp_path, rank, chunks, stealing=False)
        while owner.take()[0] is not None:
            pass
    assert thief.take()[0].index == 0
    assert thief.take() == (None, False), "the first share it looked at was spent: it stops stealing"
    assert thief.take() == (None, False)
    last = _ledger(tmp_path, rest[1], chunks, stealing=False)
    assert [last.take()[0].index for _ in range(2)] == [c.index for c in chunks if c.rank == rest[1]]
    assert None not in claims.owners(IterationLayout(tmp_path), "train", chunks)


def test_a_stealing_wave_opens_as_many_claim_files_per_rank_at_256_ranks_as_at_64(tmp_path, monkeypatch):
    """One wave (bench/stealing.py: every 4th rank 4x slower, each rank taking chunks until
    none is left for it): reading every claim not known taken before each steal, a rank opened
    about 48 N claim files (3118 a rank at 64 ranks of 32 chunks, 6194 at 128); now what a rank
    opens does not grow with N, and every chunk is still taken exactly once."""
    from bench import stealing

    monkeypatch.setattr(os, "fsync", lambda fd: None)  # opens are counted, not durability
    per_rank, most = {}, {}
    for n in (64, 256):
        result = stealing.wave(tmp_path / f"n{n}", n, chunks_per_rank=8)  # asserts every chunk taken exactly once
        assert result["stolen"] > n, result["stolen"]  # a wave: the slow ranks' chunks went to the others
        per_rank[n], most[n] = sum(result["opens"]) / n, max(result["opens"])
    assert per_rank[256] <= 1.5 * per_rank[64], per_rank
    assert most[256] <= 1.5 * most[64] and most[256] < 256 * 8 / 4, most  # no rank reads a good part of the claims


def test_a_restarted_rank_finds_the_chunks_it_holds(tmp_path):
    chunks = claims.cut([3, 3], 1)
    first = _ledger(tmp_path, 1, chunks)
    held = [first.take()[0].index, first.take()[0].index]
    assert [c.index for c in _ledger(tmp_path, 1, chunks).owned()] == held
    assert _ledger(tmp_path, 0, chunks).owned() == []


def test_a_restarted_rank_opens_as_many_files_to_find_what_it_holds_at_256_ranks_as_at_64(tmp_path, monkeypatch):
    """After a stealing wave, each rank restarted (a fresh ledger) finds exactly the chunks it
    took (bench/stealing.py checks it), reading only its own share's claims and those of the
    chunks its stolen.r<R>.json lists: reading every claim, it opened 8 N + 1 files (2049 a
    rank at 256 ranks of 8 chunks, 8193 at 256 ranks of 32)."""
    from bench import stealing

    monkeypatch.setattr(os, "fsync", lambda fd: None)  # opens are counted, not durability
    per_rank, most = {}, {}
    for n in (64, 256):
        wave = stealing.wave(tmp_path / f"n{n}", n, chunks_per_rank=8)
        opens = wave["restart_opens"]
        assert all(o <= 1 + 1 + 8 + len(wave["taken"][r]) for r, o in enumerate(opens)), opens  # dir, list, share, stolen
        per_rank[n], most[n] = sum(opens) / n, max(opens)
    assert per_rank[256] <= 1.2 * per_rank[64] and most[256] <= 1.2 * most[64], (per_rank, most)


def test_a_rank_restarted_after_a_crash_at_any_step_of_a_steal_finds_exactly_the_chunks_it_holds(tmp_path, monkeypatch):
    """Rank 1 steals chunk 5 (claimed and written), then chunk 4: killed once it listed chunk
    4 and before it created the claim, restarted; killed again between creating the claim on
    chunk 4 and writing it, restarted. Each time it holds its own chunks and chunk 5, never
    chunk 4, and what it lists survives each restart; chunk 4's first rank takes it once
    the empty claim is void."""
    it = IterationLayout(tmp_path)
    chunks = claims.cut([3, 2], 1)  # rank 0: 0, 1, 2; rank 1: 3, 4
    thief = _ledger(tmp_path, 1, chunks)
    assert [thief.take()[0].index for _ in range(3)] == [3, 4, 2]  # its own, then rank 0's last

    class Killed(BaseException):
        pass

    def killed_at(point):
        def hook(where):
            if where == point:
                raise Killed
        return hook

    crashing = claims.Ledger(it, "train", 1, chunks, stealing=True, settle_s=0.3, attempt="a", on_steal=killed_at("before-steal"))
    assert [c.index for c in crashing.owned()] == [2, 3, 4]
    with pytest.raises(Killed):
        crashing.claim(chunks[1])
    assert fsio.read_record(it.stolen("train", 1))["chunks"] == [1, 2]
    assert not it.claim("train", 1, 0).exists()
    crashing = claims.Ledger(it, "train", 1, chunks, stealing=True, settle_s=0.3, attempt="a", on_steal=killed_at("in-steal"))
    assert [c.index for c in crashing.owned()] == [2, 3, 4]
    with pytest.raises(Killed):
        crashing.claim(chunks[1])
    assert it.claim("train", 1, 0).read_bytes() == b""  # created, never written
    restarted = _ledger(tmp_path, 1, chunks, settle_s=0.3)
    assert [c.index for c in restarted.owned()] == [2, 3, 4]
    assert fsio.read_record(it.stolen("train", 1))["chunks"] == [1, 2]
    first = _ledger(tmp_path, 0, chunks, stealing=False, settle_s=0.3)
    assert first.take()[0].index == 0 and first.take() == (None, True)  # chunk 1's claim may still be being written
    time.sleep(0.35)
    assert first.take()[0].index == 1 and first.take() == (None, False)
    assert claims.owners(it, "train", chunks) == [0, 0, 1, 1, 1]
    assert [c.index for c in _ledger(tmp_path, 1, chunks).owned()] == [2, 3, 4]
    assert [c.index for c in _ledger(tmp_path, 0, chunks).owned()] == [0, 1]


def test_a_rank_whose_stolen_list_reads_damaged_reads_every_claim_instead(tmp_path):
    it = IterationLayout(tmp_path)
    chunks = claims.cut([3, 1], 1)
    thief = _ledger(tmp_path, 1, chunks)
    assert [thief.take()[0].index for _ in range(3)] == [3, 2, 1]
    data = it.stolen("train", 1).read_bytes()
    it.stolen("train", 1).write_bytes(data[: len(data) // 2])  # as sshfs can serve a file replaced by rename
    restarted = _ledger(tmp_path, 1, chunks)
    assert [c.index for c in restarted.owned()] == [1, 2, 3]
    assert restarted.take()[0].index == 0
    assert fsio.read_record(it.stolen("train", 1))["chunks"] == [0, 1, 2]  # written whole again with the next steal


def test_an_elastic_wait_reads_two_files_a_poll_while_a_chunk_is_open_whatever_the_number_of_ranks(tmp_path, monkeypatch):
    """A rank done with its work waits until every chunk is finished: it walks the chunks once,
    going on from the first it found open; before, each poll read the done list of every
    rank with a chunk not finished yet (and the claim of every chunk not known taken)."""
    from bench import stealing

    monkeypatch.setattr(os, "fsync", lambda fd: None)
    it = IterationLayout(tmp_path)
    n = 64
    chunks = claims.cut([2] * n, 1)
    for r in range(n):
        ledger = _ledger(tmp_path, r, chunks, stealing=False)
        ledger.take(), ledger.take()
        claims.note_finished(it, "train", r, {2 * r} if r % 2 else {2 * r, 2 * r + 1})  # odd ranks: one chunk to go
    waiting = _ledger(tmp_path, 0, chunks)
    opens, current = [0], [0]
    with stealing.counting_opens(opens, current):
        assert waiting.open_chunk().index == 3
        first = opens[0]
        for _ in range(3):
            assert waiting.open_chunk().index == 3
        assert opens[0] - first == 3 * 2, "the directory and rank 1's done list, each poll"
        for r in range(1, n, 2):
            claims.note_finished(it, "train", r, {2 * r, 2 * r + 1})
        opens[0] = 0
        assert waiting.open_chunk() is None
        assert opens[0] <= 1 + len(chunks) + n, opens  # the rest of the walk: each claim not read yet, each done list once
        opens[0] = 0
        assert waiting.open_chunk() is None and opens[0] == 1


def test_a_claim_left_empty_by_a_crash_is_void_after_settling_and_the_next_generation_is_taken(tmp_path):
    it = IterationLayout(tmp_path)
    chunks = claims.cut([1, 1], 1)
    it.claims("train").mkdir(parents=True)
    it.claim("train", 0, 0).write_bytes(b"")  # created, never written: its creator died in between
    ledger = _ledger(tmp_path, 0, chunks, stealing=False, settle_s=0.3)
    assert ledger.take() == (None, True)  # it may still be being written
    time.sleep(0.35)
    chunk, _ = ledger.take()
    assert chunk.index == 0 and fsio.read_record(it.claim("train", 0, 1))["rank"] == 0
    assert claims.owners(it, "train", chunks) == [0, None]


def test_a_restarted_rank_finds_a_chunk_it_claimed_behind_a_void_claim_at_once(tmp_path):
    """Rank 0 claimed generation 1 of a chunk whose generation 0 was left empty, then crashed
    before any record of it. Restarted, it holds the chunk at once: were it to wait for
    generation 0 to settle, it would find the chunk taken (by itself) when nothing is left
    to take, and nobody would do it."""
    it = IterationLayout(tmp_path)
    chunks = claims.cut([1, 1], 1)
    it.claims("train").mkdir(parents=True)
    it.claim("train", 1, 0).write_bytes(b"")  # rank 0 was killed stealing chunk 1 ...
    fsio.write_record(it.stolen("train", 2), {"rank": 2, "chunks": [1]})  # ... rank 2 listed it ...
    fsio.write_record(it.claim("train", 1, 1), {"rank": 2, "chunk": 1, "generation": 1})  # ... and took it after it settled
    restarted = _ledger(tmp_path, 2, chunks, settle_s=60)
    assert [c.index for c in restarted.owned()] == [1]
    assert _ledger(tmp_path, 1, chunks, stealing=False, settle_s=60).take() == (None, False)  # its first rank: taken


def test_a_void_claim_that_was_only_slow_still_owns_its_chunk(tmp_path):
    """The first valid generation owns the chunk, whoever wrote a later one: the aggregate
    keeps only the owner's records, so the chunk counts once though two ranks did it."""
    it = IterationLayout(tmp_path)
    chunks = claims.cut([1], 1)
    fsio.write_record(it.claim("train", 0, 1), {"rank": 0})
    fsio.write_record(it.claim("train", 0, 0), {"rank": 2})
    assert claims.owners(it, "train", chunks) == [2]


@pytest.mark.parametrize("weights", [[1, 1, 1], [3, 0, 1]])
def test_plan_ranks_are_those_with_a_positive_weight(weights):
    assert claims.plan_split(9, weights, stealing=True, chunk_tasks=0, min_chunk_tasks=1)["ranks"] == [r for r, w in enumerate(weights) if w]


def test_an_absent_rank_is_adopted_its_records_kept_and_its_unfinished_tasks_split_over_the_present(tmp_path):
    """A 3-rank plan resumed on 2 ranks: rank 2 had written 1 task of the chunk it held (and a
    torn line), and had not started its last chunk. Adoption seals its shard as it is, claims
    the untouched chunk for it, and makes new chunks of its 4 missing tasks for ranks 0 and 1."""
    from orchestrator.data import shards

    it = IterationLayout(tmp_path)
    ids = [f"t{k}" for k in range(12)]
    plan = claims.plan_split(12, [1, 1, 1], stealing=True, chunk_tasks=2, min_chunk_tasks=1)
    chunks = claims.chunks_of(plan)  # rank 2: chunks 4 (tasks 8, 9) and 5 (tasks 10, 11)
    held = _ledger(tmp_path, 2, chunks)
    assert held.take()[0].index == 4
    with shards.ShardWriter(it.shard("train", 2)) as w:
        w.append({"task_id": "t8"})
    with open(it.shard("train", 2), "ab") as f:
        f.write(b'{"task_id": "t9"')  # torn by the crash
    chunks_now = claims.all_chunks(it, "train", plan)
    assert claims.ranks_beyond(chunks_now, claims.owners(it, "train", chunks_now), 2) == [2]
    adopted, moved = claims.adopt(it, "train", plan, ids, iteration=1, ranks=[2], weights=[1, 1], attempt="b")
    assert (adopted, moved) == ([2], 3)
    m = shards.sealed(it.adopted_shard("train", 2))
    assert m is not None and m.count == 1 and m.extra["adopted"] is True
    assert claims.shard_of(it, "train", 2) == it.adopted_shard("train", 2)
    assert it.shard("train", 2).read_bytes().endswith(b'"t9"'), "the rank's own file is left as it is"
    every = claims.all_chunks(it, "train", plan)
    new = every[len(chunks):]
    assert sorted(t for c in new for t in c.tasks) == [9, 10, 11] and {c.rank for c in new} == {0, 1}
    owner = claims.owners(it, "train", every)
    assert owner[4] == owner[5] == 2 and all(owner[c.index] is None for c in new)
    moved_to = claims.task_chunks(every)
    assert moved_to[8] == 4 and all(moved_to[t] >= len(chunks) for t in (9, 10, 11))
    # a rank is adopted once
    assert claims.adopt(it, "train", plan, ids, iteration=1, ranks=[2], weights=[1, 1], attempt="c") == ([], 0)


def test_after_adoption_a_late_claim_of_the_adopted_rank_is_void_and_nobody_seals_before_every_chunk_is_finished(tmp_path):
    """Elastic: rank 2 is marked out while it holds chunk 4. Its frozen process wakes and takes
    chunk 0 (rank 0's, unclaimed): that claim counts for nothing, and chunk 0 is taken again.
    Rank 1 sees chunks open until the others list them as done, and the adoption's new chunk."""
    it = IterationLayout(tmp_path)
    ids = [f"t{k}" for k in range(6)]
    plan = claims.plan_split(6, [1, 1, 1], stealing=True, chunk_tasks=1, min_chunk_tasks=1)
    chunks = claims.chunks_of(plan)  # rank 0: 0, 1; rank 1: 2, 3; rank 2: 4, 5
    late = _ledger(tmp_path, 2, chunks)
    assert late.take()[0].index == 4
    one = _ledger(tmp_path, 1, chunks)
    assert [one.take()[0].index for _ in range(2)] == [2, 3]
    claims.note_finished(it, "train", 1, {2, 3})
    assert one.open_chunk().index == 0  # unclaimed (1, 4 and 5 are open too)

    assert claims.adopt(it, "train", plan, ids, iteration=1, ranks=[2], weights=[1, 1, 0], attempt="a") == ([2], 2)
    adoptions = claims.Adoptions.read(it, "train")
    assert adoptions.owned == {2: frozenset({4, 5})} and [c.tasks for c in adoptions.chunks] == [(4,), (5,)]
    assert late.claim(chunks[0]) is claims.Outcome.WON  # the frozen process still thinks it takes chunk 0 ...
    every = claims.all_chunks(it, "train", plan)
    assert claims.owners(it, "train", every)[0] is None  # ... but nobody counts it
    one.adopted(adoptions, every)
    assert one.open_chunk().index == 0  # its late claim on chunk 0 is void
    zero = claims.Ledger(it, "train", 0, every, stealing=True, settle_s=5.0, attempt="a", adoptions=adoptions)
    assert zero.take()[0].index == 0 and claims.owners(it, "train", every)[0] == 0
    taken = [zero.take()[0].index for _ in range(3)]
    assert taken == [1, 6, 7] and zero.take() == (None, False)
    claims.note_finished(it, "train", 0, {0, 1})
    assert one.open_chunk().index == 6  # chunks 4, 5: finished by the adoption
    claims.note_finished(it, "train", 0, {0, 1, 6, 7})
    assert one.open_chunk() is None
