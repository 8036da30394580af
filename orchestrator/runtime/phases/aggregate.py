"""Phases 3-4: the master checks every rank's seal, then streams the shards into the
iteration's aggregate, verifying each against its manifest and that every planned task is
there exactly once: a chunk's records count from the rank that owns its claim (data/claims.py)."""

from __future__ import annotations

from orchestrator.config import RunConfig, WorkloadKind
from orchestrator.phase_table import RLPhase
from orchestrator.data import carry, claims, resample, shards, staleness, summary
from orchestrator.protocol import fsio
from orchestrator.protocol.waiting import Deadline, poll
from orchestrator.runtime.context import PhaseContext
from orchestrator.runtime.phases import rollout


def _sources(ctx: PhaseContext, split: str, owner: list[int | None]) -> list[tuple[str, object]]:
    """The shard of every rank that owns a chunk of the split (``owner``: :func:`claims.owners`;
    of a rank the run went on without, the master's sealed copy of its records)."""
    return [(_label(split, r), claims.shard_of(ctx.it, split, r)) for r in sorted({o for o in owner if o is not None})]


def _label(split: str, rank: int) -> str:
    """How a source is named in errors and counts: ``rank 2``, or ``rank 2 (train-r1)`` for a
    resample round's shard."""
    return f"rank {rank}" if not resample.is_round(split) else f"rank {rank} ({split})"


def wait_for_seals(ctx: PhaseContext, split: str, sources: list[tuple[str, object]]) -> dict[str, shards.Manifest]:
    """Every rank's seal of ``split``, as its arrival announced it. A manifest is a new file:
    on a network filesystem it can show up on the master's mount later than the arrival (a
    file it already knew), so wait for each, up to one node timeout."""
    timeout = ctx.config.coordination.node_timeout_s
    found = {}
    for label, shard in sources:
        def seen(shard=shard):
            fsio.refresh_dir(shard.parent)
            return shards.sealed(shard)

        found[label] = poll(seen, deadline=Deadline.after(timeout, f"the seal of {shard}"), cancel=ctx.cancel,
                            backoff=ctx.run.backoff,
                            on_timeout=lambda label=label, shard=shard: shards.ShardError(
                                f"{label}: shard {shard} is missing or does not match its manifest "
                                f"(waited coordination.node_timeout_s={timeout:g} s)"))
    return found


def final_owners(ctx: PhaseContext, split: str, chunks: list[claims.Chunk]) -> list[int | None]:
    """Each chunk's owner once every rank has sealed. Every chunk has a valid claim by then,
    but a claim is a new file: on a network filesystem it can show up on the master's mount
    later than the seals that follow it, so read the chunks still without one again, up to one
    node timeout (then go on with what is known: the merge names what is missing)."""
    owner = claims.owners(ctx.it, split, chunks)
    deadline = Deadline.after(ctx.config.coordination.node_timeout_s, f"the claims of {split}")

    def settled():
        missing = [k for k, o in enumerate(owner) if o is None]
        for k, o in zip(missing, claims.owners(ctx.it, split, [chunks[k] for k in missing])):
            owner[k] = o
        return owner if None not in owner or deadline.expired() else None

    if None in owner:
        poll(settled, deadline=deadline.extended(1.0), cancel=ctx.cancel, backoff=ctx.run.backoff)
    return owner


def adopt_late(ctx: PhaseContext, split: str) -> None:
    """Elastic: a rank marked out after it finished its chunks, but before it sealed: its
    records are adopted now. Every rank sealed, so any task it had not done has nobody left."""
    if ctx.config.coordination.elastic and rollout.adopt_out(ctx, split):
        raise shards.ShardError(f"a rank marked out during the seal of iteration {ctx.iteration}'s {split} rollout left "
                                f"tasks undone that no rank can take any more; run the iteration again (re-run the same "
                                f"command: it resumes at this phase)")


def verify_seals(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    if not ctx.plan["train"]["enabled"]:
        return {}
    sealed = {}
    for part in rollout.train_rounds(ctx).splits:
        adopt_late(ctx, part)
        owner = final_owners(ctx, part, claims.all_chunks(ctx.it, part, ctx.plan[part]))
        sealed |= {label: m.count for label, m in wait_for_seals(ctx, part, _sources(ctx, part, owner)).items()}
    return {"sealed": sealed}


def merge_split(ctx: PhaseContext, split: str, parts: list[str] | None = None) -> shards.Manifest:
    """The split's aggregate: reused if sealed, else merged and checked against the plan.
    ``parts``: the splits whose shards it is made of, round after round, each in its plan's
    order (the train split: its resample rounds too, rl.filter_groups); None: the split alone,
    or for ``train`` the rounds the iteration opened."""
    dest = ctx.it.aggregate("pool" if split == "train" and ctx.config.rollout.partial else split)  # train: split after
    existing = shards.sealed(dest)
    if existing is not None and not existing.extra.get("partial"):
        return existing  # a salvaged partial one is replaced by the full merge
    if parts is None:
        parts = rollout.train_rounds(ctx).splits if split == "train" else [split]
    sources, keepers, position, done, planned = [], {}, {}, None, 0
    for part in parts:
        adopt_late(ctx, part)
        ids = ctx.workload.task_ids(part, ctx.iteration)[: ctx.plan[part]["total"]]
        chunks = claims.all_chunks(ctx.it, part, ctx.plan[part])
        owner = final_owners(ctx, part, chunks)  # every rank has sealed
        part_sources = _sources(ctx, part, owner)
        wait_for_seals(ctx, part, part_sources)
        sources += part_sources
        chunk_of = {ids[t]: k for t, k in claims.task_chunks(chunks).items()}
        keepers |= {task_id: _label(part, owner[k]) for task_id, k in chunk_of.items() if owner[k] is not None}
        position |= {task_id: planned + t for t, task_id in enumerate(ids)}  # the aggregate is in the plans' order
        planned += len(ids)
        part_done = work_done(chunks, owner, max(len(ctx.plan[part]["per_rank"]), ctx.config.num_nodes))
        done = part_done if done is None else {k: _added(done[k], part_done[k]) for k in done}

    def keep(label: str, record: dict) -> bool:
        return keepers.get(record["task_id"]) == label

    # A shard read cut short or stale (sshfs, NFS) fails its checksum: read it again before
    # calling it damaged.
    m = fsio.retry_transient(
        lambda: shards.merge(sources, dest, keep, lambda record: position[record["task_id"]], split=split, iteration=ctx.iteration,
                             partial=False, work=done),
        f"merging the {split} shards of iteration {ctx.iteration}", transient=(shards.ShardError,))
    if m.count != planned:
        shards.manifest_path(dest).unlink()
        dest.unlink()
        raise shards.ShardError(
            f"{split} aggregate of iteration {ctx.iteration} has {m.count} trajectories but the plan has {planned} tasks"
        )
    return m


def _added(a: list[int], b: list[int]) -> list[int]:
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))]


def work_done(chunks: list[claims.Chunk], owner: list[int | None], num_ranks: int) -> dict:
    """Tasks each rank did (``done_per_rank``) and tasks of each rank's first share that
    other ranks took (``taken_per_rank``)."""
    size = dict.fromkeys(range(len(chunks)), 0)
    for k in claims.task_chunks(chunks).values():
        size[k] += 1  # a chunk's tasks that no later chunk took over
    num_ranks = max([num_ranks, *(o + 1 for o in owner if o is not None)])
    done, taken = [0] * num_ranks, [0] * num_ranks
    for c, o in zip(chunks, owner):
        if o is not None:
            done[o] += size[c.index]
        if o is not None and o != c.rank and c.rank < num_ranks:
            taken[c.rank] += size[c.index]
    return {"done_per_rank": done, "taken_per_rank": taken}


def note_reward_errors(ctx: PhaseContext, split: str, m: shards.Manifest) -> None:
    """The split's failed reward calls (samples scored 0) into the iteration's summary."""
    count = m.extra.get("reward_errors") or 0
    if not count:
        return
    first = m.extra.get("first_reward_error") or {}
    done = (summary.read(ctx.layout, ctx.iteration) or {}).get("reward_errors") or {}
    entry = {"count": count, "samples": m.extra.get("trajectories"), "first_task_id": first.get("task_id"), "first_error": first.get("error")}
    summary.update(ctx.layout, ctx.iteration, reward_errors={**done, split: entry})
    ctx.log.warning("%d of %s %s samples of iteration %d scored 0 because rl.reward failed; first on task %s (see the "
                    "iteration's summary.json)", count, m.extra.get("trajectories"), split, ctx.iteration, first.get("task_id"))


def zero_rewards_warning(config: RunConfig, iteration: int, extra: dict) -> str | None:
    """The warning when every train sample of a run's first iteration scored 0 (``extra``: the
    train aggregate's manifest's): the update learns nothing from it, and a reward that does not
    fit the tasks' answers (exact_match on answers in ``\\boxed{}``) looks just like this while
    the run goes on. None otherwise, or where the aggregate predates the count."""
    samples, rewarded = extra.get("trajectories"), extra.get("rewarded")
    if iteration != 1 or config.workload is not WorkloadKind.RL or rewarded != 0 or not samples:
        return None
    key = "rl.environment" if config.rl.environment else "rl.reward"
    return (f"every one of the {samples} train samples of iteration 1 scored 0 under {key}={getattr(config.rl, key[3:])}: the "
            f"update has nothing to learn from. Check that {key} grades these tasks' answers (orchestrator.rewards:math takes "
            f"an answer in \\boxed{{}} or after ####; docs/rl.md, \"Rewards\") and that the model gives its answers in that form "
            f"within rl.max_tokens={config.rl.max_tokens}")


def train_aggregate(ctx: PhaseContext, parts: list[str] | None = None) -> shards.Manifest:
    """The iteration's train aggregate, merged from the ranks' shards; with rollout.partial, of
    the pool merged so, the groups trained now, and the others carried (data/carry.py)."""
    m = merge_split(ctx, "train", parts)
    if not ctx.config.rollout.partial:
        return m
    cfg = ctx.config
    bound = cfg.rl.max_staleness + cfg.rollout.max_carry
    # The update that trains it starts from checkpoint iteration - 1; a run that only rolls out
    # trains none, and its tokens' ages are counted from the policy it serves.
    update = ctx.iteration if cfg.rl_phase is RLPhase.BOTH else ctx.policy.iteration + 1
    m, split = carry.split(ctx.it.aggregate("pool"), ctx.it.aggregate("train"), ctx.it.aggregate("carry"),
                           trained=ctx.workload.trained_per_iteration(), iteration=update, bound=bound,
                           max_carry=cfg.rollout.max_carry, work=m.extra.get("work"), per_source=m.extra.get("per_source"),
                           dropped=m.extra.get("dropped"), pool=m.count)
    summary.update(ctx.layout, ctx.iteration, partial=split.summary())
    if split.dropped:
        ctx.log.warning("left out %d train group(s) of iteration %d (%d tokens) whose tokens are older than rl.max_staleness + "
                        "rollout.max_carry = %d checkpoints allow, or carried more than rollout.max_carry=%d times: tasks %s",
                        split.dropped, ctx.iteration, split.tokens_dropped, bound, cfg.rollout.max_carry,
                        ", ".join(split.dropped_ids[:5]) + (" ..." if split.dropped > 5 else ""))
    ctx.log.info("rollout.partial: %d of %d groups trained (%d carried in), %d carried to iteration %d (%d samples unfinished)",
                 split.trained, m.extra["pool"], split.carried_in, split.carried_out, ctx.iteration + 1, split.unfinished_samples)
    return m


def merge_train_shards(ctx: PhaseContext) -> None:
    if not ctx.plan["train"]["enabled"]:
        return
    rounds = rollout.train_rounds(ctx)
    m = train_aggregate(ctx, rounds.splits)
    trajectories = m.extra.get("trajectories", m.count)
    done = m.extra.get("work") or {}
    policies = m.extra.get("policy_iterations")
    summary.update(ctx.layout, ctx.iteration, trajectories=trajectories, tasks_done_per_rank=done.get("done_per_rank"),
                   tasks_taken_per_rank=done.get("taken_per_rank"),
                   staleness=[staleness.staleness(ctx.iteration, p) for p in reversed(policies)] if policies else None)
    if m.extra.get("dropped"):
        ctx.log.warning("left out %d train records of chunks done twice (a void claim whose rank went on)", m.extra["dropped"])
    note_reward_errors(ctx, "train", m)
    if (warning := zero_rewards_warning(ctx.config, ctx.iteration, m.extra)) is not None:
        ctx.log.warning("%s", warning)
    ctx.log.info("aggregated %d train trajectories (%d tasks) of iteration %d", trajectories, m.count, ctx.iteration)
    if len(resample.planned(ctx.plan)) > 1:
        note_resampling(ctx, rounds)


def note_resampling(ctx: PhaseContext, rounds: resample.Rounds) -> None:
    """rl.filter_groups: the rounds the iteration rolled out, the tasks they drew and how many
    of their groups are informative, into the summary (``resample``)."""
    entry = {"rounds": len(rounds.splits) - 1, "tasks": sum(ctx.plan[part]["total"] for part in rounds.splits),
             "informative": rounds.informative, "wanted": ctx.plan["train"]["total"]}
    summary.update(ctx.layout, ctx.iteration, resample=entry)
    ctx.log.info("rl.filter_groups: %d informative groups of %d wanted, from %d tasks in %d resample round(s)", entry["informative"],
                 entry["wanted"], entry["tasks"], entry["rounds"])
