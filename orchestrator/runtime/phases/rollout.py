"""Phases 1-2: each rank rolls out chunks of the split into its own shard, then seals it.

A rank takes its own chunks of the plan first, then, with work stealing, chunks not yet
started from the ranks with the most left (data/claims.py): the phase ends when the work ends.
With coordination.elastic a rank seals only once every chunk is finished, and the master
hands the unfinished work of a rank it marked out to the others as new chunks.
The shard is appended in small fsynced batches; a restarted rank keeps what its shard
already holds and finishes the chunks it had claimed. A sealed shard is never regenerated.
"""

from __future__ import annotations

import contextlib

from orchestrator import terminal
from orchestrator.data import carry, claims, resample, shards
from orchestrator.node import placement
from orchestrator.protocol import fsio
from orchestrator.runtime.context import PhaseContext

_BATCH_WAIT_S = 0.1  # how often the wait for the next batch looks at the rank's cancel token


def weights(ctx: PhaseContext) -> list[float]:
    """Each rank's rollout weight now: a rank the run goes on without has none."""
    given = placement.rollout_weights(ctx.run.placement, ctx.config.rank_weights)
    out = ctx.run.out | (ctx.run.lost() if ctx.is_master else frozenset())
    return [0.0 if r in out else w for r, w in enumerate(given)]


def ledger(ctx: PhaseContext, split: str) -> claims.Ledger:
    """This rank's claims on the split's chunks in this iteration."""
    split_plan = ctx.plan[split]
    steal = ctx.config.coordination.work_stealing and weights(ctx)[ctx.rank] > 0
    adoptions = claims.Adoptions.read(ctx.it, split)
    return claims.Ledger(ctx.it, split, ctx.rank, claims.all_chunks(ctx.it, split, split_plan, adoptions), stealing=steal,
                       settle_s=ctx.config.coordination.node_timeout_s, attempt=ctx.attempt_id,
                       on_steal=lambda point: ctx.fault_point(f"hold-{point}"),
                       adoptions=adoptions)


def adopt_out(ctx: PhaseContext, split: str) -> int:
    """Master, elastic: hand the unfinished work of the ranks it marked out to the others.
    Returns how many tasks moved."""
    out = sorted(ctx.run.lost())
    if not out:
        return 0
    ids = ctx.workload.task_ids(split, ctx.iteration)[: ctx.plan[split]["total"]]
    adopted, moved = claims.adopt(ctx.it, split, ctx.plan[split], ids, iteration=ctx.iteration, ranks=out, weights=weights(ctx),
                                attempt=ctx.attempt_id)
    if moved:
        ctx.log.warning("the %s records of ranks %s so far are kept, and their %d unfinished task(s) of iteration %d go to the "
                        "ranks in the run", split, ",".join(map(str, adopted)), moved, ctx.iteration)
    return moved


def _refresh(ctx: PhaseContext, split: str, held: claims.Ledger) -> bool:
    """Elastic: take in the master's latest adoptions; True when there are new chunks."""
    if ctx.is_master:
        adopt_out(ctx, split)
    adoptions = claims.Adoptions.read(ctx.it, split)
    if len(adoptions.chunks) == len(held.adoptions.chunks) and adoptions.owned.keys() == held.adoptions.owned.keys():
        return False
    held.adopted(adoptions, claims.all_chunks(ctx.it, split, ctx.plan[split], adoptions))
    return True


def generate_shard(ctx: PhaseContext, split: str, gated: bool = False) -> None:
    """This rank's part of ``split``. ``gated`` (the train rounds of rl.filter_groups): like
    elastic, the rank notes each chunk it finishes, with its informative groups, and leaves
    only once every chunk of the split is finished, when the next round can be decided."""
    path = ctx.it.shard(split, ctx.rank)
    _offset, count = ctx.share(split)
    if shards.sealed(path) is not None:
        ctx.log.info("%s shard of iteration %d is sealed already: reusing it", split, ctx.iteration)
        ctx.progress(count, count)
        return
    if shards.sealed(ctx.it.adopted_shard(split, ctx.rank)) is not None:
        ctx.log.warning("the run went on without this rank in the %s rollout of iteration %d (its records were adopted): "
                        "it takes no more of that work", split, ctx.iteration)
        return
    ids = ctx.workload.task_ids(split, ctx.iteration)
    elastic = ctx.config.coordination.elastic
    tracked = elastic or gated  # finished chunks noted, and the phase waits for every chunk
    held = ledger(ctx, split)
    moved = claims.task_chunks(held.chunks)  # a task of an adopted rank's chunk may be another chunk's now
    finished = claims.finished_chunks(ctx.it, split, ctx.rank) if tracked else set()
    partial = split == "train" and ctx.config.rollout.partial  # stop once enough groups are complete (data/carry.py)
    mark = resample.informative if gated else (lambda record: bool(record.get("unfinished"))) if partial else None

    def note() -> None:
        counts = resample.chunk_counts(held.chunks, ids, moved, writer.marked, finished) if gated else None
        claims.note_finished(ctx.it, split, ctx.rank, finished, counts)

    with shards.ShardWriter(path, mark=mark) as writer, contextlib.closing(ctx.workload.rollout_pipe(ctx, split)) as pipe:
        queue = held.owned()
        done = len(writer.task_ids)
        if done:
            ctx.log.info("resuming %s shard: %d tasks already there, %d chunk(s) claimed", split, done, len(queue))
        ctx.progress(done, count)
        first_batch = True
        unfinished: dict[int, set[str]] = {}  # chunk -> its submitted tasks not yet durable
        with terminal.progress(f"iteration {ctx.iteration} {split} rollout", count, done) as bar:
            while True:
                pending = False
                if elastic and _refresh(ctx, split, held):
                    moved = claims.task_chunks(held.chunks)
                while pipe.wants_more():  # claimed only when the engines can take it: the rest stays free to steal
                    if queue:
                        chunk = queue.pop(0)
                    else:
                        chunk, pending = held.take()
                        if chunk is None:
                            break
                        if chunk.rank != ctx.rank:
                            ctx.log.info("took %s chunk %d (%d tasks) from rank %d", split, chunk.index, chunk.size, chunk.rank)
                            ctx.run.took(split, chunk.index, chunk.size, chunk.rank)
                    todo = [ids[t] for t in chunk.tasks if moved[t] == chunk.index and ids[t] not in writer.task_ids]
                    if todo:
                        unfinished[chunk.index] = set(todo)
                        pipe.submit(todo)
                    else:
                        finished.add(chunk.index)
                        if tracked:
                            note()  # done before a restart: the others (and this rank's wait) see it finished
                if not pipe.outstanding:
                    if not pending and (not tracked or held.open_chunk() is None):
                        break
                    # A claim is settling (see whether it is void), or (elastic) others still work:
                    # a rank marked out meanwhile leaves chunks for this one.
                    ctx.cancel.sleep(ctx.config.coordination.poll_max_s)
                    continue
                # The phase's deadline bounds this wait: the monitor cancels the rank when it passes.
                ctx.cancel.check()
                stopping = partial and _enough(ctx, writer, pipe, held)
                if stopping:  # the rest of its share too, claimed now and carried unbegun
                    rest, settling = held.claim_own()
                    queue += rest
                    stopping = not settling
                left = []
                for chunk in queue if stopping else ():
                    todo = [ids[t] for t in chunk.tasks if moved[t] == chunk.index and ids[t] not in writer.task_ids]
                    unfinished[chunk.index] = set(todo)  # finished once the stop's batch is durable
                    left += todo
                queue = [] if stopping else queue
                batch = pipe.stop(left) if stopping else pipe.next_batch(_BATCH_WAIT_S)
                if stopping:
                    cut = sum(1 for r in batch if r.get("unfinished"))
                    ctx.log.info("%d of the %d train groups this rank took are complete (rollout.partial): stopped the %d "
                                 "unfinished, carried to the next rollout", len(writer.task_ids) - len(writer.marked) + len(batch)
                                 - cut, len(writer.task_ids) + len(batch), cut)
                if not batch:
                    continue
                for record in batch:
                    writer.append(record)
                writer.flush()  # each batch is durable before it is counted: progress shown is progress kept
                done += len(batch)
                total = held.expected()
                ctx.progress(done, total)
                bar.update(done, total)
                if first_batch:
                    first_batch = False
                    ctx.fault_point("hold-after-round-batch" if resample.is_round(split) else "hold-after-batch")
                if tracked:
                    finished |= _settled(unfinished, batch)
                    note()
        if tracked:
            note()  # chunks found with nothing left to do


def _enough(ctx: PhaseContext, writer: shards.ShardWriter, pipe, held: claims.Ledger) -> bool:
    """rollout.partial: whether this rank has its share of complete groups (data/carry.py,
    ``target``, of the tasks it holds or will: its own chunks and those it took), none in hand
    may be carried again, and something is left to stop."""
    if pipe.outstanding <= pipe.ready or pipe.overdue(ctx.config.rollout.max_carry):
        return False
    complete = len(writer.task_ids) - len(writer.marked) + pipe.ready  # durable or about to be, in the batch the stop returns
    return complete >= carry.target(held.expected(), ctx.config.rollout.oversample)


def _settled(unfinished: dict[int, set[str]], batch: list[dict]) -> set[int]:
    """The chunks whose last submitted task ``batch`` made durable (removed from ``unfinished``)."""
    for record in batch:
        for tasks in unfinished.values():
            tasks.discard(record["task_id"])
    settled = {chunk for chunk, tasks in unfinished.items() if not tasks}
    for chunk in settled:
        del unfinished[chunk]
    return settled


def seal_shard(ctx: PhaseContext, split: str) -> dict:
    shard = claims.shard_of(ctx.it, split, ctx.rank)
    if shard != ctx.it.shard(split, ctx.rank):  # adopted: the master sealed its copy
        m = shards.sealed(shard)
        return {"split": split, "count": m.count, "sha256": m.sha256}
    m = fsio.retry_transient(lambda: shards.seal(shard, rank=ctx.rank, split=split, iteration=ctx.iteration), f"sealing {shard}")
    return {"split": split, "count": m.count, "sha256": m.sha256}


def generate_train_shard(ctx: PhaseContext) -> None:
    """The train split; with rl.filter_groups, then each resample round the ones before it
    call for (data/resample.py)."""
    if not ctx.plan["train"]["enabled"]:
        return
    rounds = resample.planned(ctx.plan)
    generate_shard(ctx, "train", gated=len(rounds) > 1)
    done = 0
    while True:
        opens = resample.next_round_opens(ctx.it, ctx.plan, done, lambda split: ctx.workload.task_ids(split, ctx.iteration))
        if opens is None:  # a chunk is not finished yet (this rank's work was adopted): the phase deadline bounds the wait
            ctx.cancel.sleep(ctx.config.coordination.poll_max_s)
            continue
        if not opens:
            return
        done += 1
        ctx.log.info("fewer than %d informative groups so far (rl.filter_groups): rolling out resample round %d of %d",
                     ctx.plan["train"]["total"], done, len(rounds) - 1)
        generate_shard(ctx, rounds[done], gated=True)


def train_rounds(ctx: PhaseContext) -> resample.Rounds:
    """The train splits this iteration rolled out (``train``, and the resample rounds it
    opened), and their informative groups."""
    return resample.opened(ctx.it, ctx.plan, lambda split: ctx.workload.task_ids(split, ctx.iteration))


def seal_train_shard(ctx: PhaseContext) -> dict | None:
    if not ctx.plan["train"]["enabled"]:
        return None
    seals = [seal_shard(ctx, split) for split in train_rounds(ctx).splits]
    return seals[0] if len(seals) == 1 else {**seals[0], "rounds": seals[1:]}
