"""How one iteration's update is cut up: optimizer steps, the samples each train worker takes
in a step, the rows it packs them into and the micro-batches of a token budget that it
accumulates gradients over.

The update does not depend on how many train workers there are, nor on the budget:

- Steps are global. Each epoch shuffles all records with a generator seeded by (seed, epoch)
  and cuts that order into steps of ``batch_records`` records; the last may be shorter.
- A step's samples are dealt to the workers by tokens (:func:`deal`): longest first, each
  to the worker with the fewest so far, so that each worker's share is within one sample's
  length of every other's, however long the tail. The log-prob passes under a fixed policy
  (the old policy's, the reference's) are dealt the same way over all the samples, once,
  and the workers then share what they computed (train/batches.py).
- The loss of a step is the mean over the whole step, every worker's part included, of its
  tokens (``rl.loss_agg=token_mean``) or its sequences (the others): each worker sums its
  tokens' losses, scaled (grpo.token_scale), and divides by ``step_tokens / world_size`` or
  ``step_samples / world_size``, so that the gradient mean DDP and FSDP take over the
  workers is that mean. Samples out of the loss (``Lengths.trained_tokens``) count in neither.
- A worker lays its samples out in rows (:func:`micro_batches`). Padded (``packing`` off):
  one sample a row, micro-batches of rows whose padded size (rows x longest row) stays
  within ``budget``. Packed: samples one after another in rows as wide as the step's
  longest sample (first fit, longest first), as many rows a micro-batch as the budget
  holds: no row is wider than a padded batch's would be, so attention, which a packed row
  computes over its whole width, costs no more than padded. A single sample longer than
  the budget is a micro-batch of its own; 0: one micro-batch.

Every worker runs the same number of forward passes in a step (``slots``), and the same
number of log-prob passes: FSDP gathers parameters at every forward, and DDP reduces at
the last backward, collectively. A worker with fewer micro-batches runs empty ones, which
compute a forward on any sample and weigh it by zero.

Everything here is computed from the whole aggregate, which every worker reads, so every
worker knows every other worker's plan without asking.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

Key = tuple[int, int]
"""(record index in file order, sample index within the record)."""
Row = list[Key]
"""Samples laid one after another in one row of a batch (one, unless packed)."""
MicroBatch = list[Row]
"""Rows computed in one forward pass, each padded to the longest."""


@dataclass(frozen=True, slots=True)
class Lengths:
    """Per record, per sample: its row (prompt + completion tokens) and its completion tokens."""

    rows: list[list[int]]
    completions: list[list[int]]
    trained_tokens: list[list[int]] | None = None
    """Per record, per sample: its tokens in the loss (fewer than its completion's when some
    are out of it: rl.overlong=mask, an observation's tokens); a sample with none does not
    count. None: every token of every sample."""

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("no records to train on")

    def counted(self, record: int) -> tuple[int, int]:
        """The record's (completion tokens, samples) in the loss's normaliser."""
        if self.trained_tokens is None:
            return sum(self.completions[record]), len(self.completions[record])
        return sum(self.trained_tokens[record]), sum(1 for t in self.trained_tokens[record] if t)


@dataclass(frozen=True, slots=True)
class Step:
    micro_batches: list[MicroBatch]
    """This worker's micro-batches, padded with empty ones to the step's ``slots``."""
    tokens: int
    """Completion tokens of the whole step, over all workers, that the loss counts."""
    samples: int = 0
    """Samples of the whole step, over all workers, that the loss counts."""

    def normalizer(self, loss_agg: str, world_size: int) -> float:
        """What each worker divides its part of the loss by (module docstring)."""
        return max(self.tokens if loss_agg == "token_mean" else self.samples, 1) / world_size


def epoch_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"grpo-shuffle:{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


def epoch_order(n_records: int, *, seed: int, epoch: int) -> list[int]:
    """All records in this epoch's shuffled order (the same on every worker)."""
    import torch

    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(n_records, generator=generator).tolist()


def steps_per_epoch(n_records: int, batch_records: int) -> int:
    return math.ceil(n_records / batch_records)


def keys_of(micro_batch: MicroBatch) -> list[Key]:
    """The samples of a micro-batch in the order of its flat per-token tensors (row by row)."""
    return [key for row in micro_batch for key in row]


def tokens(micro_batch: MicroBatch, rows: list[list[int]]) -> tuple[int, int]:
    """(real tokens, tokens computed: rows x the widest row, padding included) of a micro-batch."""
    widths = [sum(rows[k][i] for k, i in row) for row in micro_batch]
    return sum(widths), len(widths) * max(widths, default=0)


def deal(keys: list[Key], rows: list[list[int]], world_size: int) -> list[list[Key]]:
    """``keys`` shared out among the workers by tokens: longest first (ties in key order),
    each to the worker holding the fewest tokens so far (ties: the lowest), so that each
    share is within one sample's length of every other. Each share keeps ``keys``' order (one
    worker's share is ``keys`` as they are)."""
    position = {key: i for i, key in enumerate(keys)}
    shares: list[list[Key]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for key in sorted(keys, key=lambda k: (-rows[k[0]][k[1]], k)):
        w = min(range(world_size), key=lambda i: (loads[i], i))
        shares[w].append(key)
        loads[w] += rows[key[0]][key[1]]
    return [sorted(share, key=position.__getitem__) for share in shares]


def micro_batches(keys: list[Key], rows: list[list[int]], budget: int, packing: bool, width: int = 0) -> list[MicroBatch]:
    """``keys`` laid out in rows and cut into micro-batches within ``budget`` tokens, padding
    included (0: one micro-batch); packed rows are ``width`` wide (at least the longest of
    ``keys``); module docstring."""
    if not keys:
        return []
    if not packing:
        return [[[key] for key in mb] for mb in pack(keys, rows, budget)]
    size = {key: rows[key[0]][key[1]] for key in keys}
    width = max(width, *size.values())
    if budget:
        width = min(width, budget)  # a sample longer than that is a row of its own
    packed: list[list[Key]] = []
    room: list[int] = []
    for key in sorted(keys, key=lambda k: (-size[k], k)):  # first fit decreasing
        fit = next((i for i, left in enumerate(room) if left >= size[key]), None)
        if fit is None:
            packed.append([key])
            room.append(max(width - size[key], 0))
        else:
            packed[fit].append(key)
            room[fit] -= size[key]
    per = len(packed) if not budget else max(1, budget // width)
    return [packed[i : i + per] for i in range(0, len(packed), per)]


def pack(keys: list[Key], rows: list[list[int]], budget: int) -> list[list[Key]]:
    """``keys`` in order, cut into micro-batches whose padded size fits ``budget`` (0: one)."""
    out: list[list[Key]] = []
    current: list[Key] = []
    widest = 0
    for key in keys:
        row = rows[key[0]][key[1]]
        if current and budget and (len(current) + 1) * max(widest, row) > budget:
            out.append(current)
            current, widest = [], 0
        current.append(key)
        widest = max(widest, row)
    if current:
        out.append(current)
    return out


def _samples(records: list[int], lengths: Lengths) -> list[Key]:
    return [(k, s) for k in records for s in range(len(lengths.rows[k]))]


def every_sample(lengths: Lengths) -> list[Key]:
    """Every sample of every record, in file order."""
    return _samples(list(range(len(lengths.rows))), lengths)


def _longest(samples: list[Key], lengths: Lengths) -> int:
    return max(lengths.rows[k][i] for k, i in samples)


def _padded(shares: list[list[MicroBatch]], rank: int) -> list[MicroBatch]:
    """This worker's micro-batches, with empty ones to as many as the worker with the most."""
    slots = max(1, *map(len, shares))
    mine = shares[rank]
    return mine + [[] for _ in range(slots - len(mine))]


def update_plan(lengths: Lengths, *, world_size: int, rank: int, batch_records: int, budget: int, seed: int, epochs: int,
                packing: bool = False) -> list[list[Step]]:
    """This worker's steps, epoch by epoch."""
    n = len(lengths.rows)
    plan = []
    for epoch in range(epochs):
        order = epoch_order(n, seed=seed, epoch=epoch)
        steps = []
        for start in range(0, n, batch_records):
            chunk = order[start : start + batch_records]
            samples = _samples(chunk, lengths)
            width = _longest(samples, lengths)
            laid = [micro_batches(share, lengths.rows, budget, packing, width) for share in deal(samples, lengths.rows, world_size)]
            counted = [lengths.counted(k) for k in chunk]
            steps.append(Step(_padded(laid, rank), sum(c[0] for c in counted), sum(c[1] for c in counted)))
        plan.append(steps)
    return plan


def logprob_plan(lengths: Lengths, *, world_size: int, budget: int, packing: bool = False) -> list[list[MicroBatch]]:
    """Every worker's forward passes that compute log-probs under a fixed policy: all the
    samples dealt by tokens, each worker's in passes of the budget (padded: each pass holds
    one record's samples), padded with empty passes to the count of the worker that has the
    most. Indexed by worker."""
    samples = every_sample(lengths)
    width = _longest(samples, lengths)
    shares = deal(samples, lengths.rows, world_size)
    if packing:
        laid = [micro_batches(share, lengths.rows, budget, True, width) for share in shares]
    else:  # a record's samples at a time, in file order
        laid = [[mb for k in sorted({k for k, _ in share}) for mb in micro_batches([key for key in share if key[0] == k], lengths.rows, budget, False)]
                for share in shares]
    return [_padded(laid, w) for w in range(world_size)]
