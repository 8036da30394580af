"""How an update is cut up (train/plan.py): steps that do not depend on the number of
workers, every sample once per epoch, micro-batches within the token budget, and every
worker running as many passes as every other."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.train import plan


def _lengths(n: int, seed: int = 0) -> plan.Lengths:
    rng = random.Random(seed)
    rows, completions = [], []
    for _ in range(n):
        samples = rng.randint(1, 5)
        prompt = rng.randint(2, 9)
        done = [rng.randint(0, 7) for _ in range(samples)]
        rows.append([prompt + c for c in done])
        completions.append(done)
    return plan.Lengths(rows, completions)


def _width(micro_batch: plan.MicroBatch, rows: list[list[int]]) -> int:
    return max(sum(rows[k][i] for k, i in row) for row in micro_batch)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 30), world=st.integers(1, 5), batch=st.integers(1, 12), budget=st.sampled_from([0, 1, 12, 30, 100]),
       seed=st.integers(0, 3), packing=st.booleans())
def test_steps_cover_every_sample_once_per_epoch_whatever_the_workers_budget_and_packing(n, world, batch, budget, seed, packing):
    lengths = _lengths(n, seed)
    plans = [plan.update_plan(lengths, world_size=world, rank=r, batch_records=batch, budget=budget, seed=seed, epochs=2,
                              packing=packing) for r in range(world)]
    alone = plan.update_plan(lengths, world_size=1, rank=0, batch_records=batch, budget=0, seed=seed, epochs=2)
    for epoch in range(2):
        order = plan.epoch_order(n, seed=seed, epoch=epoch)
        assert all(len(p[epoch]) == plan.steps_per_epoch(n, batch) for p in plans)
        for s, step in enumerate(alone[epoch]):
            parts = [p[epoch][s] for p in plans]
            # Every worker runs the same number of passes; together they hold the step's samples once.
            assert len({len(part.micro_batches) for part in parts}) == 1
            keys = [k for part in parts for mb in part.micro_batches for k in plan.keys_of(mb)]
            assert sorted(keys) == sorted(plan.keys_of(step.micro_batches[0]))
            assert {k for k, _ in keys} == set(order[s * batch : (s + 1) * batch])
            assert all(part.tokens == step.tokens for part in parts)
            assert step.tokens == sum(lengths.completions[k][i] for k, i in keys)
            # Shared by tokens: each worker's within one sample's length of every other's.
            loads = [sum(lengths.rows[k][i] for mb in part.micro_batches for k, i in plan.keys_of(mb)) for part in parts]
            assert max(loads) - min(loads) <= max(lengths.rows[k][i] for k, i in keys)
            widest = max(lengths.rows[k][i] for k, i in keys)
            for part in parts:
                for mb in part.micro_batches:
                    assert packing or all(len(row) == 1 for row in mb)
                    assert all(sum(lengths.rows[k][i] for k, i in row) <= widest for row in mb), "a row wider than the step's longest sample"
                    if budget and mb and (len(mb) > 1 or len(mb[0]) > 1):
                        assert len(mb) * _width(mb, lengths.rows) <= budget, "only a sample alone may pass the budget"
        everything = sorted(k for step in alone[epoch] for mb in step.micro_batches for k in plan.keys_of(mb))
        assert everything == [(k, i) for k in range(n) for i in range(len(lengths.rows[k]))]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), world=st.integers(1, 5), budget=st.sampled_from([0, 1, 15, 40]), packing=st.booleans())
def test_logprob_passes_cover_every_sample_once_in_equal_counts_shared_by_tokens(n, world, budget, packing):
    lengths = _lengths(n)
    passes = plan.logprob_plan(lengths, world_size=world, budget=budget, packing=packing)
    assert len(passes) == world and len({len(p) for p in passes}) == 1
    keys = [k for mine in passes for mb in mine for k in plan.keys_of(mb)]
    assert sorted(keys) == [(k, i) for k in range(n) for i in range(len(lengths.rows[k]))]
    loads = [sum(lengths.rows[k][i] for mb in mine for k, i in plan.keys_of(mb)) for mine in passes]
    assert max(loads) - min(loads) <= max(max(r) for r in lengths.rows)
    if not packing:
        assert all(len({k for k, _ in plan.keys_of(mb)}) <= 1 for mine in passes for mb in mine), "a padded pass holds one record's samples"


def test_packing_fills_rows_as_wide_as_the_longest_sample_first_fit_longest_first():
    """Rows as wide as the longest of the samples, or as ``width`` (the step's longest) when wider."""
    rows = [[10, 3, 3, 3, 6, 4]]
    keys = [(0, i) for i in range(6)]
    assert plan.micro_batches(keys, rows, budget=0, packing=True) == [[[(0, 0)], [(0, 4), (0, 5)], [(0, 1), (0, 2), (0, 3)]]]
    assert plan.micro_batches(keys, rows, budget=20, packing=True) == [[[(0, 0)], [(0, 4), (0, 5)]], [[(0, 1), (0, 2), (0, 3)]]]
    assert plan.micro_batches(keys, rows, budget=0, packing=False) == [[[k] for k in keys]]
    assert plan.micro_batches(keys[1:], rows, budget=0, packing=True, width=10) == [[[(0, 4), (0, 5)], [(0, 1), (0, 2), (0, 3)]]]
    assert plan.micro_batches(keys[1:], rows, budget=0, packing=True) == [[[(0, 4)], [(0, 5)], [(0, 1), (0, 2)], [(0, 3)]]]


def test_a_long_tail_is_dealt_so_that_no_worker_holds_the_step():
    """One sample of 1,000 tokens and 39 of 50: by index, worker 0 would hold 1,950 tokens
    and worker 1 1,000; by tokens they hold 1,500 and 1,450."""
    rows = [[1000] + [50] * 39]
    shares = plan.deal([(0, i) for i in range(40)], rows, 2)
    assert [sum(rows[0][i] for _, i in share) for share in shares] == [1500, 1450]
    assert shares[0][0] == (0, 0) and sorted(shares[0] + shares[1]) == [(0, i) for i in range(40)]


def test_one_padded_worker_with_no_budget_takes_whole_steps_in_the_shuffled_order():
    """One worker's padded update is laid out as it was before samples were dealt by tokens."""
    lengths = _lengths(10)
    steps = plan.update_plan(lengths, world_size=1, rank=0, batch_records=4, budget=0, seed=5, epochs=1)[0]
    order = plan.epoch_order(10, seed=5, epoch=0)
    assert [plan.keys_of(step.micro_batches[0]) for step in steps] == [
        [(k, i) for k in order[j : j + 4] for i in range(len(lengths.rows[k]))] for j in (0, 4, 8)]


def test_a_sample_longer_than_the_budget_is_a_micro_batch_of_its_own():
    rows = [[10, 3, 3, 3]]
    assert plan.pack([(0, i) for i in range(4)], rows, budget=6) == [[(0, 0)], [(0, 1), (0, 2)], [(0, 3)]]


def test_shuffle_depends_on_seed_and_epoch_and_nothing_else():
    assert plan.epoch_order(40, seed=3, epoch=0) == plan.epoch_order(40, seed=3, epoch=0)
    assert plan.epoch_order(40, seed=3, epoch=0) != plan.epoch_order(40, seed=3, epoch=1)
    assert plan.epoch_order(40, seed=3, epoch=0) != plan.epoch_order(40, seed=4, epoch=0)


def test_no_records_is_an_error():
    with pytest.raises(ValueError, match="no records"):
        plan.Lengths([], [])


def test_the_normaliser_counts_the_trained_tokens_or_sequences_of_the_whole_step():
    lengths = plan.Lengths(rows=[[5, 7], [4]], completions=[[2, 4], [1]], trained_tokens=[[2, 0], [1]])
    assert lengths.counted(0) == (2, 1) and lengths.counted(1) == (1, 1)
    for world in (1, 2):
        steps = [plan.update_plan(lengths, world_size=world, rank=r, batch_records=2, budget=0, seed=0, epochs=1)[0][0]
                 for r in range(world)]
        assert {(s.tokens, s.samples) for s in steps} == {(3, 2)}
        assert steps[0].normalizer("token_mean", world) == 3 / world
        assert steps[0].normalizer("seq_mean_token_mean", world) == 2 / world
    untouched = plan.Lengths(rows=[[5, 7]], completions=[[2, 4]])
    assert untouched.counted(0) == (6, 2)
