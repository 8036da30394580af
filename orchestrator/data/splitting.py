"""Rank-weighted task splitting by the largest-remainder (Hamilton) method.

Each rank gets ``floor(total * w_r / sum(w))`` tasks; the leftover tasks go one each to
the ranks with the largest fractional remainders, ties broken by the lower rank (a rank of
weight 0 gets none: its remainder is 0 and a positive one always exists). The
result is deterministic, sums to ``total``, and no rank is ever more than one task away
from its exact proportional share. Fractions are computed exactly (``fractions.Fraction``)
so that float rounding never changes who gets a leftover task.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence


def split_counts(total: int, weights: Sequence[float]) -> list[int]:
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if not weights or any(not (w >= 0) for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with at least one positive, got {list(weights)}")
    exact = [Fraction(w) for w in weights]
    denom = sum(exact)
    quotas = [total * w / denom for w in exact]
    counts = [int(q) for q in quotas]  # floor: quotas are non-negative
    leftover = total - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda r: (-(quotas[r] - counts[r]), r))
    for r in by_remainder[:leftover]:
        counts[r] += 1
    return counts


def split_items(items: Sequence[str], weights: Sequence[float]) -> list[list[str]]:
    """Contiguous slices of ``items`` with the sizes :func:`split_counts` gives."""
    out, start = [], 0
    for n in split_counts(len(items), weights):
        out.append(list(items[start : start + n]))
        start += n
    return out
