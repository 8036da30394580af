"""Partial rollouts (``rollout.partial``): the groups a train rollout leaves unfinished, carried
into the next iteration's rollout and trained where their last sample finishes.

The train rollout of an iteration is a pool of :func:`pool` tasks, rl.train_tasks plus
rollout.oversample more: the groups the iteration before carried come first, then new tasks. A
rank stops its engines (their abort) once it has :func:`target` complete groups of the tasks it
took, and writes each group it had not finished into its shard as it stands: a record with
``unfinished: true`` whose unfinished samples (finish reason ``abort``) hold what they sampled so
far (``token_ids``, ``logprobs``, ``text``). Every sample a record carries names the policies
that sampled its tokens (``policy_versions``: ``[[checkpoint iteration, tokens], ...]`` in
order). So each task is in exactly one shard once, as it always is, and survives a crash there.

The aggregate (:func:`split`) trains the first rl.train_tasks complete groups in the plan's
order (the carried ones first) and carries the others, complete or not, into the iteration's
carry aggregate, each with ``carried`` counted up; the next rollout continues their unfinished
samples as token-id prompts under its policy, with what is left of rl.max_tokens. A token is
never trained more than rl.max_staleness + rollout.max_carry checkpoints after the one that
sampled it: a group carried rollout.max_carry times is not stopped again (the rollout waits for
it), and a record found past the bound is dropped and counted, never trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from orchestrator.data import shards
from orchestrator.protocol import fsio

ABORTED = "abort"
"""The finish reason of a sample its engine stopped (the engine's pause): it is continued."""


def pool(train_tasks: int, oversample: float) -> int:
    """Tasks a partial train rollout rolls out: rl.train_tasks and rollout.oversample more."""
    return math.ceil(round(train_tasks * (1 + oversample), 6))


def target(taken: int, oversample: float) -> int:
    """Complete groups a rank waits for among the ``taken`` tasks it rolled out before it stops
    the rest: its share of the pool's trained groups, rounded up (so the ranks' together are at
    least rl.train_tasks, whichever rank took which chunk)."""
    return min(taken, math.ceil(round(taken / (1 + oversample), 6)))


def unfinished(sample: dict) -> bool:
    return sample.get("finish_reason") == ABORTED


def length(sample: dict) -> int:
    """The ids ``sample`` holds after its prompt: its ``token_ids`` and, an agent's that started
    new segments, theirs before them (what ``policy_versions`` counts)."""
    return sum(len(s.get("token_ids") or ()) for s in (*sample.get("segments", ()), sample))


def versions(record: dict, sample: dict) -> list[list[int]]:
    """``[[checkpoint iteration, tokens], ...]``: the policies that sampled ``sample``'s tokens."""
    return sample.get("policy_versions") or [[record["policy_iteration"], length(sample)]]


def with_versions(record: dict) -> dict:
    """``record`` (a group cut or continued) with every sample naming its tokens' policies, and the
    record's ``policy_iteration`` the oldest of them (what the staleness check reads)."""
    samples = [{**s, "policy_versions": versions(record, s)} for s in record["samples"]]
    oldest = min((v for s in samples for v, n in s["policy_versions"] if n), default=record["policy_iteration"])
    return {**record, "samples": samples, "policy_iteration": oldest}


def extended(runs: list[list[int]], tokens: int, policy_iteration: int) -> list[list[int]]:
    """``runs`` (``policy_versions``) with ``tokens`` more of ``policy_iteration``'s."""
    runs = [list(r) for r in runs]
    if runs and runs[-1][0] == policy_iteration:
        runs[-1][1] += tokens
    elif tokens:
        runs.append([policy_iteration, tokens])
    return runs


def continued(sample: dict, more: dict, policy_iteration: int) -> dict:
    """``sample`` (carried, unfinished) with ``more`` (what its continuation sampled: text,
    token_ids, logprobs, finish_reason) appended, the new tokens named by ``policy_iteration``."""
    return {**sample, "text": sample["text"] + more["text"], "token_ids": sample["token_ids"] + more["token_ids"],
            "logprobs": (sample.get("logprobs") or []) + (more.get("logprobs") or []), "finish_reason": more["finish_reason"],
            "policy_versions": extended(sample["policy_versions"], len(more["token_ids"]), policy_iteration)}


def token_ages(record: dict, iteration: int) -> Iterator[tuple[int, int]]:
    """(age, tokens) of ``record``'s sampled tokens for the update of ``iteration``: how many
    checkpoints behind the one it starts from (``iteration - 1``) each policy is."""
    for s in record["samples"]:
        for v, n in versions(record, s):
            yield iteration - 1 - v, n


@dataclass(slots=True)
class Split:
    """What :func:`split` made of an iteration's pool."""
    trained: int = 0
    carried_in: int = 0
    """Trained groups that earlier rollouts had carried."""
    carried_out: int = 0
    unfinished_samples: int = 0
    """Samples of the carried-out groups not finished yet."""
    dropped: int = 0
    """Groups past the staleness bound: never trained."""
    tokens_dropped: int = 0
    tokens_trained: int = 0
    age_max: int = 0
    age_tokens: int = 0
    """Trained tokens times their age, summed (the mean's numerator)."""
    dropped_ids: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """The iteration summary's ``partial`` entry (status, the trackers)."""
        return {"trained": self.trained, "carried_in": self.carried_in, "carried_out": self.carried_out,
                "unfinished_samples": self.unfinished_samples, "dropped": self.dropped, "tokens_dropped": self.tokens_dropped,
                "token_age_max": self.age_max,
                "token_age_mean": self.age_tokens / self.tokens_trained if self.tokens_trained else 0.0}


def split(whole: Path, train: Path, carry: Path, *, trained: int, iteration: int, bound: int, max_carry: int,
          **extra) -> tuple[shards.Manifest, Split]:
    """Make the train aggregate (the first ``trained`` complete groups of ``whole``, the merged
    pool in the plan's order) and the carry aggregate (the rest, ``carried`` counted up) of
    ``iteration``; a group with a token more than ``bound`` checkpoints old, or carried more than
    ``max_carry`` times, is in neither. Carry first: a sealed train aggregate means both are
    there. Returns the train aggregate's manifest (``extra`` in it) and the counts."""
    out, take = Split(), set()
    for _end, _raw, record in shards.iter_valid_lines(whole):
        ages = list(token_ages(record, iteration))
        stale = any(a > bound for a, n in ages if n) or record.get("carried", 0) > max_carry or (
            record.get("unfinished") and record.get("carried", 0) >= max_carry)
        if stale:
            out.dropped += 1
            out.dropped_ids.append(record["task_id"])
            out.tokens_dropped += sum(n for _a, n in ages)
        elif not record.get("unfinished") and len(take) < trained:
            take.add(record["task_id"])
            out.trained += 1
            out.carried_in += bool(record.get("carried"))
            out.tokens_trained += sum(n for _a, n in ages)
            out.age_tokens += sum(a * n for a, n in ages)
            out.age_max = max([out.age_max, *(a for a, n in ages if n)])
    dropped = set(out.dropped_ids)
    for stale in (shards.manifest_path(carry), carry):  # what a crash in an earlier try left
        stale.unlink(missing_ok=True)
    with shards.ShardWriter(carry) as writer:
        for _end, _raw, record in shards.iter_valid_lines(whole):
            if record["task_id"] in take or record["task_id"] in dropped:
                continue
            out.carried_out += 1
            out.unfinished_samples += sum(map(unfinished, record["samples"]))
            begun = any(s.get("token_ids") for s in record["samples"])  # one never sent is a new task again
            writer.append({**with_versions(record), "carried": record.get("carried", 0) + 1 if begun else 0,
                           "origin_iteration": record.get("origin_iteration") or record["iteration"]})
    shards.seal(carry, iteration=iteration, split="carry")
    m = shards.merge([("the pool", whole)], train, lambda _label, record: record["task_id"] in take, split="train",
                     iteration=iteration, partial=False, **extra)
    return m, out


def ensure(path: Path, iteration: int) -> None:
    """The master, planning the iteration after ``iteration``: an empty carry aggregate where
    ``iteration`` was rolled out without rollout.partial, so that every rank finds one to read."""
    if shards.read_manifest(path) is None and not path.exists():
        shards.seal(path, iteration=iteration, split="carry")


def read(path: Path) -> list[dict] | None:
    """The carry aggregate at ``path`` (sealed, verified), or None while there is none to see
    (a new file: on NFS it may show up late on another node). Raises ShardError for one that
    does not match its manifest."""
    fsio.refresh_dir(path.parent)
    m = shards.read_manifest(path)
    if m is None and not path.exists():
        return None
    if m is None or not shards.verify(path, m):
        raise shards.ShardError(f"the carried groups {path} do not match their manifest: delete both files and the "
                                f"iteration's train aggregate, and re-run the same command to aggregate that iteration again")
    return [record for _end, _raw, record in shards.iter_valid_lines(path)]
