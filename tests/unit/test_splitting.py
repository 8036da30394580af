"""Largest-remainder task splitting: deterministic, exact, proportional (property-tested)."""

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from orchestrator.data.splitting import split_counts, split_items

weights = st.lists(st.integers(min_value=1, max_value=1000).map(lambda w: w / 10), min_size=1, max_size=64)


@given(total=st.integers(min_value=0, max_value=100_000), weights=weights)
def test_split_sums_to_total_and_each_share_is_within_one_of_its_quota(total, weights):
    counts = split_counts(total, weights)
    assert sum(counts) == total
    denom = sum(Fraction(w) for w in weights)
    for c, w in zip(counts, weights):
        quota = total * Fraction(w) / denom
        assert quota - 1 < c < quota + 1


@given(total=st.integers(min_value=0, max_value=10_000), weights=weights)
def test_split_is_deterministic_and_leftovers_go_to_largest_remainders(total, weights):
    counts = split_counts(total, weights)
    assert counts == split_counts(total, list(weights))
    denom = sum(Fraction(w) for w in weights)
    quotas = [total * Fraction(w) / denom for w in weights]
    got_extra = [r for r, c in enumerate(counts) if c > int(quotas[r])]
    no_extra = [r for r, c in enumerate(counts) if c == int(quotas[r])]
    for a in got_extra:
        for b in no_extra:
            ra, rb = quotas[a] - int(quotas[a]), quotas[b] - int(quotas[b])
            assert ra > rb or (ra == rb and a < b)


def test_documented_examples():
    assert split_counts(12, [2, 1, 1]) == [6, 3, 3]
    assert split_counts(10, [2, 1, 1]) == [5, 3, 2]  # tie on .5: lower rank first
    assert split_counts(1, [1, 1, 1]) == [1, 0, 0]
    assert split_items(["a", "b", "c", "d"], [1, 3]) == [["a"], ["b", "c", "d"]]
