"""How one iteration's update is cut up: optimizer steps, the records each train worker takes
in a step, and the micro-batches of a token budget that it accumulates gradients over.

The update does not depend on how many train workers there are, nor on the budget:

- Steps are global. Each epoch shuffles all records with a generator seeded by (seed, epoch)
  and cuts that order into steps of ``batch_records`` records; the last may be shorter.
- Record k belongs to train worker ``k % world_size``: that worker computes its old and
  reference log-probs once, and trains on it in every step that holds it.
- The loss of a step is the mean over the whole step, every worker's part included, of its
  tokens (``rl.loss_agg=token_mean``) or its sequences (the others): each worker sums its
  tokens' losses, scaled (grpo.token_scale), and divides by ``step_tokens / world_size`` or
  ``step_samples / world_size``, so that the gradient mean DDP and FSDP take over the
  workers is that mean. Samples out of the loss (``Lengths.trained_tokens``) count in neither.
- A worker packs its samples of a step, in order, into micro-batches whose padded size
  (rows x longest row) stays within ``micro_batch_tokens`` (0: one micro-batch); a single
  sample longer than the budget is a micro-batch of its own.

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
    micro_batches: list[list[Key]]
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


def owner(record: int, world_size: int) -> int:
    return record % world_size


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


def update_plan(lengths: Lengths, *, world_size: int, rank: int, batch_records: int, budget: int, seed: int, epochs: int) -> list[list[Step]]:
    """This worker's steps, epoch by epoch."""
    n = len(lengths.rows)
    plan = []
    for epoch in range(epochs):
        order = epoch_order(n, seed=seed, epoch=epoch)
        steps = []
        for start in range(0, n, batch_records):
            chunk = order[start : start + batch_records]
            per_worker = [pack(_samples([k for k in chunk if owner(k, world_size) == w], lengths), lengths.rows, budget) for w in range(world_size)]
            slots = max(1, *map(len, per_worker))
            mine = per_worker[rank]
            counted = [lengths.counted(k) for k in chunk]
            steps.append(Step(mine + [[] for _ in range(slots - len(mine))], sum(c[0] for c in counted), sum(c[1] for c in counted)))
        plan.append(steps)
    return plan


def logprob_plan(lengths: Lengths, *, world_size: int, rank: int, budget: int) -> list[list[Key]]:
    """The forward passes that compute this worker's records' log-probs under a fixed policy:
    each of its records (file order) in passes of the budget, padded with empty passes to the
    count of the worker that has the most."""
    n = len(lengths.rows)

    def passes(w: int) -> list[list[Key]]:
        return [mb for k in range(w, n, world_size) for mb in pack(_samples([k], lengths), lengths.rows, budget)]

    mine = passes(rank)
    slots = max(len(passes(w)) for w in range(world_size))
    return mine + [[] for _ in range(slots - len(mine))]
