"""DAPO's dynamic sampling in the rollout (``rl.filter_groups``): an iteration draws further
train prompts, round after round, until ``rl.train_tasks`` of its groups are informative (their
rewards vary) or ``rl.max_resample_rounds`` rounds are spent.

Round 0 is the iteration's train split. Round k >= 1 is a split of its own, ``train-r<k>``:
planned with the iteration (``plan.json``: its tasks, drawn from the train file without those
of earlier rounds, and its chunks over the ranks) and rolled out like any split (claims, work
stealing, shards, adoption), but only once the rounds before it are finished and hold fewer
informative groups than wanted. The phase 4 merge puts every opened round's records into the
one train aggregate; the update leaves out the groups that are not informative
(train/batches.py). Each drawn task is recorded exactly once, whatever crashes: a round is
an ordinary split.

Every rank decides alike, from the same files, without a barrier: each rank waits until every
chunk of the round is finished (``claims/<split>/done.r<R>.json`` lists them, with how many of
each chunk's groups are informative), then counts. A chunk counts from its owner (its first
valid claim, data/claims.py), as the merge keeps it; of a rank the master adopted, from the
master's sealed copy of its records.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.data import claims, shards
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import IterationLayout

TRAIN = "train"
PREFIX = "train-r"


def split_of(round_: int) -> str:
    return TRAIN if round_ == 0 else f"{PREFIX}{round_}"


def is_round(split: str) -> bool:
    return split.startswith(PREFIX) and split[len(PREFIX):].isdigit()


def round_of(split: str) -> int:
    """The round a train split is (0 for ``train``)."""
    return int(split[len(PREFIX):]) if is_round(split) else 0


def base(split: str) -> str:
    """The task file a split draws from: ``train`` for every round."""
    return TRAIN if is_round(split) else split


def planned(plan: dict) -> list[str]:
    """The iteration's train splits as planned: ``train``, then each resample round's."""
    return [TRAIN] + [split_of(k) for k in range(1, (plan.get(TRAIN) or {}).get("resample_rounds", 0) + 1) if split_of(k) in plan]


def informative(record: dict) -> bool:
    """Whether a record's group is informative: its samples' rewards are not all equal."""
    rewards = [s.get("reward") for s in record.get("samples") or [] if isinstance(s, dict)]
    return len(set(rewards)) > 1


def chunk_counts(chunks: list[claims.Chunk], ids: list[str], moved: dict[int, int], marked: set[str], finished: set[int]) -> dict[int, int]:
    """How many of each finished chunk's tasks are in ``marked`` (the rank's informative
    records); ``moved``: each task position's chunk (claims.task_chunks)."""
    by_index = {c.index: c for c in chunks}
    return {k: sum(1 for t in by_index[k].tasks if moved.get(t) == k and ids[t] in marked) for k in finished if k in by_index}


def informative_count(it: IterationLayout, split: str, split_plan: dict, ids: list[str]) -> int | None:
    """The informative groups of ``split``'s records, counted chunk by chunk from its owner;
    None while a chunk is not finished."""
    adoptions = claims.Adoptions.read(it, split)
    chunks = claims.all_chunks(it, split, split_plan, adoptions)
    owner = claims.owners(it, split, chunks)
    moved = claims.task_chunks(chunks)
    notes: dict[int, dict] = {}
    total = 0
    for chunk, rank in zip(chunks, owner):
        if rank is None:
            return None
        if rank not in notes:
            notes[rank] = _counts(it, split, rank, adoptions, chunks, ids, moved)
        counted = notes[rank].get(chunk.index)
        if counted is None:
            return None
        total += counted
    return total


def _counts(it: IterationLayout, split: str, rank: int, adoptions: claims.Adoptions, chunks: list[claims.Chunk], ids: list[str],
            moved: dict[int, int]) -> dict[int, int]:
    """Per chunk ``rank`` finished, its informative groups: from the rank's done file, or, for a
    rank the master adopted, from the master's sealed copy of its records (every chunk it held
    is finished: what it had not done is in the master's new chunks)."""
    if rank in adoptions.owned:
        adopted = it.adopted_shard(split, rank)
        if shards.sealed(adopted) is None:
            return {}
        marked = {r["task_id"] for _end, _raw, r in shards.iter_valid_lines(adopted) if informative(r)}
        return chunk_counts(chunks, ids, moved, marked, set(adoptions.owned[rank]))
    note = fsio.read_record(it.done_chunks(split, rank)) or {}
    return {int(k): n for k, n in (note.get("informative") or {}).items()}


def next_round_opens(it: IterationLayout, plan: dict, round_: int, ids_of) -> bool | None:
    """After round ``round_`` of the iteration: whether the next one is rolled out (fewer
    informative groups than the train split's total in rounds 0..``round_``, and a next round
    planned); None while a chunk of those rounds is not finished. ``ids_of(split)``: the
    split's task ids, as the plan's positions index them."""
    splits = planned(plan)
    if round_ + 1 >= len(splits):
        return False
    found = 0
    for split in splits[: round_ + 1]:
        count = informative_count(it, split, plan[split], ids_of(split))
        if count is None:
            return None
        found += count
    return found < plan[TRAIN]["total"]


@dataclass(frozen=True, slots=True)
class Rounds:
    splits: list[str]
    """The train splits the iteration rolled out: ``train``, then the resample rounds it opened."""
    informative: int
    """Their informative groups."""


def opened(it: IterationLayout, plan: dict, ids_of) -> Rounds:
    """What the iteration rolled out, once its rollout is over (every round decided): the same
    rule as :func:`next_round_opens`, each round counted once."""
    splits, found = planned(plan), 0
    for k, split in enumerate(splits):
        count = informative_count(it, split, plan[split], ids_of(split))
        found += count or 0
        if count is None or found >= plan[TRAIN]["total"] or k + 1 == len(splits):
            return Rounds(splits[: k + 1], found)
    raise AssertionError("planned() always holds the train split")
