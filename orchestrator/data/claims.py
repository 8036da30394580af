"""Rollout and eval work in chunks, taken through exclusive claim files (work stealing).

The plan cuts a split's task list into chunks and gives each rank a first share of them
(``--rank-weights``, data/splitting.py). A rank takes a chunk by creating its claim file
with ``O_CREAT|O_EXCL`` (``iterations/<I>/claims/<split>/c<K>.<G>.json``): one creator wins
and is the file's only writer, and only that rank writes the chunk's records. A rank takes
its own chunks front to back; without stealing it takes exactly those.

With ``coordination.work_stealing`` a rank with none of its own left takes the last unclaimed
chunks of other ranks' shares (:meth:`Ledger.take`). Owners take from the front and thieves
from the back, so the unclaimed chunks of a share form one run in its middle: a thief finds
where that run starts and ends by bisection, reading O(log C) of the share's C claim files,
and remembers every claim it found written (a written claim stands, unless the master
adopts its rank: :meth:`Ledger.adopted`). Each steal compares up to :data:`VICTIMS_PER_STEAL`
shares, the one it last stole from and the next ones in its own random order of the others,
and takes the last unclaimed chunk of the one with the most tasks unclaimed; a thief gives
up once :data:`STEAL_PROBES` shares in a row had nothing left. So a rank reads O((chunks it steals + 1) x (VICTIMS_PER_STEAL + STEAL_PROBES) x log C)
claim files in a stealing wave whatever the number of ranks N, and a wave O(N) in all
(reading every claim not known taken before each steal, it was 32 N a steal, over 32 N^2 a
wave; docs/performance.md, section 12). Stealing only ever helps: a rank goes on until each
of its own chunks has a valid claim, taking those nobody stole (and those a void claim
freed), so a thief that gives up early, or misses a free chunk (a void claim leaves a gap
in the run), costs time, never a task.

A thief lists each chunk of another share in its own ``claims/<split>/stolen.r<R>.json``
(one writer, rewritten whole) before it creates the chunk's claim: one more small write a
steal. So the claims a rank may hold are those of its own chunks (its first share, and
what adoptions gave it; the master claims for an adopted rank only chunks of its first
share) and those its list names, and a restarted rank reads only those
(:meth:`Ledger.owned`): O(own chunks + chunks stolen) opens, not one per chunk of the split
(32 N). A chunk listed whose claim the thief then lost, or never created (killed in
between), reads as taken or free. Only a list that reads damaged sends it back to every claim.

A run resumed on fewer nodes leaves ranks of the plan absent: when the attempt starts inside
a split's rollout, the master adopts them (:func:`adopt`): it copies each absent rank's
records into a sealed shard of its own (``r<R>.adopted.jsonl``; every fsynced record
counts), claims for it the chunks of its first share nobody took, and hands every task it
owned but had not done to the present ranks as new chunks
(``iterations/<I>/claims/<split>/adopted.json``, which maps those tasks to the new chunks).

With ``coordination.elastic`` the master adopts a rank it marked out while the others run,
the same way; from then on that rank's claims count only for the chunks it held when it was
adopted (``owned``), so whatever a frozen process does once it wakes changes nothing. And no
rank seals before every chunk is finished (``claims/<split>/done.r<R>.json``, one writer
each): an adoption may still hand it new chunks. A finished chunk stays finished until the
next adoption, so a waiting rank walks the chunks once, each poll going on from the first
it found open (:meth:`Ledger.open_chunk`): a poll reads that chunk's owner's list, not one
list per rank still working.

A crash between creating a claim and writing it leaves an empty claim: once it has stayed
invalid for ``settle_s`` it is void, and the chunk is claimed at the next generation ``G+1``.
The owner of a chunk is the writer of its first valid generation (:func:`owners`); the
aggregate keeps only the owner's records of each chunk, so even a void claim that was merely
slow (its creator went on and did the chunk too) has every task counted once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from orchestrator.data import shards
from orchestrator.data.splitting import split_counts
from orchestrator.node import identity
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import IterationLayout

CHUNKS_PER_RANK = 32
"""With work stealing, about this many chunks per rank (coordination.chunk_tasks=0): the phase
ends up to one chunk of the slowest rank late, so chunks must be small (bench/stealing.py:
1.18x the ideal with 16 per rank, 1.06x with 32; docs/performance.md, section 12)."""

VICTIMS_PER_STEAL = 4
"""Shares a thief compares before each steal (the one with the most tasks unclaimed loses its
last chunk): with up to this many other ranks rolling out, it is the rank with the most left."""

STEAL_PROBES = CHUNKS_PER_RANK
"""A thief gives up once this many shares in a row (since its last steal) had nothing left.
Each thief finds a given share with work left with odds of about STEAL_PROBES / N when all
others are done, so even then about this many thieves find it: enough to take a share of
CHUNKS_PER_RANK chunks in one round."""


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    rank: int
    """The rank whose first share holds it."""
    tasks: tuple[int, ...]
    """Positions in the iteration's task ids of the split."""

    @property
    def size(self) -> int:
        return len(self.tasks)


def plan_split(total: int, weights: Sequence[float], *, stealing: bool, chunk_tasks: int, min_chunk_tasks: int) -> dict:
    """A split's part of the iteration plan: the first share of each rank (``per_rank``), the
    ranks that roll out (positive weight), and the chunks. Without stealing, or with a single
    rank rolling out, a rank's share is one chunk."""
    per_rank = split_counts(total, weights)
    takers = [r for r, w in enumerate(weights) if w > 0]
    if chunk_tasks > 0:
        size = chunk_tasks
    elif not stealing or len(takers) <= 1:
        size = max(1, total)
    else:
        size = max(1, min_chunk_tasks, math.ceil(total / (len(takers) * CHUNKS_PER_RANK)))
    return {"total": total, "per_rank": per_rank, "ranks": takers, "chunk_tasks": size,
            "chunks": [[c.tasks[0], c.tasks[-1] + 1, c.rank] for c in cut(per_rank, size)]}


def cut(per_rank: Sequence[int], size: int, tasks: Sequence[int] | None = None, first_index: int = 0) -> list[Chunk]:
    """Each rank's contiguous share of ``tasks`` (default: 0, 1, ...), in rank order, cut into
    chunks of at most ``size``, numbered from ``first_index``."""
    tasks = range(sum(per_rank)) if tasks is None else tasks
    chunks, start = [], 0
    for rank, n in enumerate(per_rank):
        for s in range(start, start + n, size):
            chunks.append(Chunk(first_index + len(chunks), rank, tuple(tasks[s : min(s + size, start + n)])))
        start += n
    return chunks


def chunks_of(split_plan: dict) -> list[Chunk]:
    """The chunks of a split's plan (a plan written before chunks existed: one per rank)."""
    if "chunks" in split_plan:
        return [Chunk(k, r, tuple(range(s, e))) for k, (s, e, r) in enumerate(split_plan["chunks"])]
    return cut(split_plan["per_rank"], max(1, split_plan["total"]))


class Outcome(enum.Enum):
    WON = "won"
    TAKEN = "taken"
    """Another rank holds a valid claim."""
    PENDING = "pending"
    """A claim exists that is not valid yet (being written, or void once it stays so)."""


class _Side(enum.Enum):
    """Where a chunk stands in its share, as a thief sees it."""

    FRONT = "front"
    """Claimed by the share's own rank (which takes it front to back)."""
    BACK = "back"
    """Claimed by a thief (thieves take it back to front)."""
    FREE = "free"
    CLAIMED = "claimed"
    """A claim that is not valid (yet), or one this rank just lost a race for: not free."""


@dataclass(frozen=True, slots=True)
class Adoptions:
    """The master's record of the ranks whose work it handed to others (``adopted.json``)."""

    chunks: tuple[Chunk, ...] = ()
    """The chunks made of their unfinished tasks, numbered after the plan's."""
    owned: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    """Adopted rank -> the chunks its claims count for: those it held when it was adopted."""

    @classmethod
    def read(cls, it: IterationLayout, split: str) -> "Adoptions":
        chunks, owned = [], {}
        for entry in (fsio.read_record(it.adopted(split)) or {}).get("adoptions", []):
            chunks += [Chunk(k, r, tuple(tasks)) for k, r, tasks in entry["chunks"]]
            owned.update({int(r): frozenset(ks) for r, ks in entry.get("owned", {}).items()})
        return cls(tuple(chunks), owned)

    def counts(self, rank: int, chunk: int) -> bool:
        """Whether a valid claim of ``rank`` on ``chunk`` makes it the owner."""
        held = self.owned.get(rank)
        return held is None or chunk in held


class Ledger:
    """One rank's view of a split's chunks and claims in one iteration."""

    def __init__(self, it: IterationLayout, split: str, rank: int, chunks: list[Chunk], *, stealing: bool, settle_s: float,
                 attempt: str, on_steal: Callable[[str], None] = lambda _where: None, adoptions: Adoptions = Adoptions()):
        """``on_steal(point)``: called at "before-steal" (the chunk listed in ``stolen.r<R>.json``,
        its claim not created yet), "in-steal" (claim created, not yet written) and "after-steal"
        (written, no record yet), for tests' fault holds."""
        self.it, self.split, self.rank, self.chunks = it, split, rank, chunks
        self.stealing, self.settle_s, self.attempt, self.on_steal = stealing, settle_s, attempt, on_steal
        self.adoptions = adoptions
        self.owner: dict[int, int] = {}
        """Chunk -> the rank of its valid claim, as far as this rank knows (a claim changes only
        when its rank is adopted: :meth:`adopted`)."""
        self.finished: dict[int, set[int]] = {}
        """Rank -> the chunks it has finished, as far as this rank knows (elastic)."""
        self._invalid_since: dict[tuple[int, int], float] = {}
        self._stolen: set[int] | None = None
        """The chunks of other shares listed in this rank's ``stolen.r<R>.json``, once read."""
        self._index()

    def _index(self) -> None:
        """This rank's own chunks, and the others' shares as thieves see them: runs of
        consecutive chunks of one rank (its first share, then what each adoption gave it), each
        taken from the front by that rank and from the back by thieves."""
        self._own = [c for c in self.chunks if c.rank == self.rank]
        runs: list[list[Chunk]] = []
        for c in self.chunks:
            if runs and runs[-1][-1].rank == c.rank and runs[-1][-1].index + 1 == c.index:
                runs[-1].append(c)
            else:
                runs.append([c])
        self._shares = [tuple(run) for run in runs if run[0].rank != self.rank]
        self._order = list(range(len(self._shares)))
        random.Random(f"{self.split}/{self.rank}").shuffle(self._order)  # thieves spread over the victims
        self._next = 0
        """Where in ``_order`` the next steal looks first."""
        self._spent: set[int] = set()
        """Shares found with every chunk claimed (a void claim in one is left to its own rank)."""
        self._victim: int | None = None
        self._misses = 0
        """Shares found spent since the last steal: at STEAL_PROBES, this rank stops stealing."""
        self._open_from = 0
        """Elastic: every chunk before this one is finished (:meth:`open_chunk`)."""

    def adopted(self, adoptions: Adoptions, chunks: list[Chunk]) -> None:
        """The master adopted more ranks: their new chunks join, and their claims beyond what
        they held are void."""
        self.adoptions, self.chunks = adoptions, chunks
        self.owner = {k: r for k, r in self.owner.items() if adoptions.counts(r, k)}
        self._index()

    # -- reading claims ----------------------------------------------------------------------

    def _read(self, chunk: Chunk) -> tuple[Outcome | None, int]:
        """The state of ``chunk``'s claim chain: (None, G) when generation G is free to
        claim; (TAKEN or WON, G) when generation G holds a valid claim; (PENDING, G) when G is
        invalid and has not been so for ``settle_s`` yet."""
        g = 0
        while True:
            data = fsio.read_bytes(self.it.claim(self.split, chunk.index, g))
            if data is None:
                return None, g
            body = fsio.parse_record(data)
            if body is not None and not self.adoptions.counts(body["rank"], chunk.index):
                g += 1  # taken by a rank after the master adopted it: void
                continue
            if body is not None:
                self.owner[chunk.index] = body["rank"]
                return (Outcome.WON if body["rank"] == self.rank else Outcome.TAKEN), g
            if self.it.claim(self.split, chunk.index, g + 1).exists():
                g += 1  # void: a rank saw it settle and claimed the next generation
                continue
            first = self._invalid_since.setdefault((chunk.index, g), time.monotonic())
            if time.monotonic() - first < self.settle_s:
                return Outcome.PENDING, g
            g += 1  # void: its creator died before writing it

    def owned(self) -> list[Chunk]:
        """The chunks this rank holds valid claims on (a restarted rank's unfinished work). It
        claims only its own chunks (its first share, and what adoptions gave it) and those its
        ``stolen.r<R>.json`` lists (each listed before its claim is created), so it reads only
        theirs: O(own chunks + chunks stolen) opens, whatever the number of ranks."""
        fsio.refresh_dir(self.it.claims(self.split))
        stolen = self._stolen_list()
        return [c for c in self.chunks if (c.rank == self.rank or c.index in stolen) and self._read(c)[0] is Outcome.WON]

    def _stolen_list(self) -> set[int]:
        """The chunks of other shares this rank may hold: its ``stolen.r<R>.json``, read once (a
        restarted process goes on with its predecessor's list)."""
        if self._stolen is None:
            data = fsio.read_bytes(self.it.stolen(self.split, self.rank))
            body = fsio.parse_record(data)
            if body is not None:
                self._stolen = set(body["chunks"])
            elif data is None:
                self._stolen = set()  # it never stole in this split
            else:
                # Unreadable (sshfs can serve a file replaced by rename cut short): every claim of
                # other shares, read the slow way; a claim that is not valid yet is void soon.
                self._stolen = {c.index for c in self.chunks if c.rank != self.rank and self._read(c)[0] is Outcome.WON}
        return self._stolen

    def _list_stolen(self, chunk: Chunk) -> None:
        """List ``chunk`` in ``stolen.r<R>.json`` before claiming it, so that this rank, restarted
        after a crash at any point, finds it among those it may hold. One more small write per
        steal (the claim's exclusive create costs as much); a chunk whose claim it then lost
        stays listed, harmlessly: reading its claim shows it taken."""
        stolen = self._stolen_list()
        if chunk.index not in stolen:
            fsio.write_record(self.it.stolen(self.split, self.rank), {"rank": self.rank, "chunks": sorted(stolen | {chunk.index})})
            stolen.add(chunk.index)
            self.on_steal("before-steal")

    def expected(self) -> int:
        """Tasks this rank does, as far as it knows now: the chunks it holds, and its own not yet taken."""
        return sum(c.size for c in self.chunks
                   if self.owner.get(c.index) == self.rank or (c.rank == self.rank and c.index not in self.owner))

    # -- taking ------------------------------------------------------------------------------

    def claim(self, chunk: Chunk) -> Outcome:
        state, g = self._read(chunk)
        while state is None:
            stolen = chunk.rank != self.rank
            if stolen:
                self._list_stolen(chunk)
            body = {"rank": self.rank, "chunk": chunk.index, "generation": g, "first_rank": chunk.rank, "attempt": self.attempt,
                    "host": identity.host(), "pid": os.getpid()}
            hook = (lambda: self.on_steal("in-steal")) if stolen else None
            if fsio.create_record_exclusive(self.it.claim(self.split, chunk.index, g), body, before_write=hook):
                self.owner[chunk.index] = self.rank
                if stolen:
                    self.on_steal("after-steal")
                return Outcome.WON
            state, g = self._read(chunk)
        return state

    def claim_own(self) -> tuple[list[Chunk], bool]:
        """Claim every chunk of this rank's own not claimed yet (partial rollouts: a rank that
        stops early keeps its share's rest, to carry it unbegun). (the chunks it won, whether a
        claim of its own is still settling)."""
        won, pending = [], False
        for chunk in self._own:
            if chunk.index not in self.owner:
                outcome = self.claim(chunk)
                if outcome is Outcome.WON:
                    won.append(chunk)
                pending |= outcome is Outcome.PENDING
        return won, pending

    def take(self) -> tuple[Chunk | None, bool]:
        """The next chunk for this rank: its own first, then (stealing) another's.
        (chunk, False) or (None, True) when a claim of its own is still settling and nothing
        else is free (poll again); (None, False): no work is left for this rank."""
        pending = False
        for chunk in self._own:
            if chunk.index not in self.owner:
                outcome = self.claim(chunk)
                if outcome is Outcome.WON:
                    return chunk, False
                pending |= outcome is Outcome.PENDING
        if not self.stealing or self._misses >= STEAL_PROBES or len(self._spent) == len(self._shares):
            return None, pending  # (asked again after each batch of its last chunks: no more reads)
        fsio.refresh_dir(self.it.claims(self.split))
        seen: dict[int, _Side] = {}  # this call's reads of claims not written yet
        while True:
            best = None  # ((tasks unclaimed, -rank), share, first, end): the most left, then the lowest rank
            for share in self._candidates():
                first, end = self._unclaimed(self._shares[share], seen)
                if first == end:
                    self._spent.add(share)
                    self._misses += 1
                    continue
                key = (sum(c.size for c in self._shares[share][first:end]), -self._shares[share][0].rank)
                if best is None or key > best[0]:
                    best = (key, share, first, end)
            if best is None:
                if self._misses >= STEAL_PROBES or len(self._spent) == len(self._shares):
                    return None, pending
                continue
            _key, share, first, end = best
            chunk = self._last_free(self._shares[share], first, end, seen)
            if chunk is None:
                self._spent.add(share)  # a gap the bisection stepped over: its own rank takes it
                self._misses += 1
                continue
            outcome = self.claim(chunk)
            if outcome is Outcome.WON:
                self._victim, self._misses = share, 0
                self._next = (self._next + VICTIMS_PER_STEAL) % max(1, len(self._order))
                return chunk, False
            seen[chunk.index] = _Side.CLAIMED  # another thief won it, or its claim is being written

    def _candidates(self) -> list[int]:
        """The shares to compare for the next steal: the last victim's, then the next ones in
        this rank's order, none known spent."""
        out = [] if self._victim is None or self._victim in self._spent else [self._victim]
        n = len(self._order)
        for k in range(n):
            if len(out) >= VICTIMS_PER_STEAL:
                break
            share = self._order[(self._next + k) % n]
            if share not in self._spent and share not in out:
                out.append(share)
        return out

    def _side(self, chunk: Chunk, seen: dict[int, _Side]) -> _Side:
        """Who holds ``chunk``, read once per call (a written claim: once for good)."""
        owner = self.owner.get(chunk.index)
        if owner is None and chunk.index not in seen:
            state, _g = self._read(chunk)
            owner = self.owner.get(chunk.index) if state in (Outcome.WON, Outcome.TAKEN) else None
            if owner is None:
                seen[chunk.index] = _Side.FREE if state is None else _Side.CLAIMED
        if owner is None:
            return seen[chunk.index]
        return _Side.FRONT if owner == chunk.rank else _Side.BACK

    def _unclaimed(self, share: tuple[Chunk, ...], seen: dict[int, _Side]) -> tuple[int, int]:
        """The run of ``share``'s unclaimed chunks, [first, end), found by bisection: its rank
        claims its chunks front to back (each one after all before it), thieves back to front
        (each one after all behind it), so the share reads as FRONT* FREE* BACK* (a claim being
        written, either side). Empty when every chunk is claimed."""
        lo, hi = 0, len(share)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._side(share[mid], seen) in (_Side.FRONT, _Side.CLAIMED):
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(share)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._side(share[mid], seen) in (_Side.BACK, _Side.CLAIMED):
                hi = mid
            else:
                lo = mid + 1
        return first, lo

    def _last_free(self, share: tuple[Chunk, ...], first: int, end: int, seen: dict[int, _Side]) -> Chunk | None:
        """The last unclaimed chunk of ``share[first:end]`` (the run's end, unless a void claim
        left a gap the bisection took for the run)."""
        for chunk in reversed(share[first:end]):
            if self._side(chunk, seen) is _Side.FREE:
                return chunk
        return None

    def open_chunk(self) -> Chunk | None:
        """Elastic: the first chunk not finished yet, as far as this rank can tell (None: every
        chunk is). A chunk is open while it is unclaimed, or held by a rank in the run that has
        not listed it as done; a chunk of an adopted rank is finished (what it had not done is in
        the master's new chunks). A finished chunk stays so (done lists only grow; an adoption,
        which can void a claim, starts the walk again: :meth:`adopted`), so each call goes on
        from the chunk the last one found open: one walk over the chunks for the whole wait, and
        a poll while that chunk is still open opens two files (the directory, its owner's done
        list), not one per rank still working."""
        fsio.refresh_dir(self.it.claims(self.split))
        reread: set[int] = set()  # ranks whose done list this call has read
        while self._open_from < len(self.chunks):
            chunk = self.chunks[self._open_from]
            if not self._finished(chunk, reread):
                return chunk
            self._open_from += 1
        return None

    def _finished(self, chunk: Chunk, reread: set[int]) -> bool:
        owner = self.owner.get(chunk.index)
        if owner is None:
            state, _ = self._read(chunk)
            owner = self.owner.get(chunk.index) if state in (Outcome.WON, Outcome.TAKEN) else None
        if owner is None:
            return False
        if owner in self.adoptions.owned:
            return True
        if chunk.index not in self.finished.get(owner, set()) and owner not in reread:
            reread.add(owner)
            self.finished[owner] = finished_chunks(self.it, self.split, owner)
        return chunk.index in self.finished[owner]


def finished_chunks(it: IterationLayout, split: str, rank: int) -> set[int]:
    return set((fsio.read_record(it.done_chunks(split, rank)) or {}).get("chunks", []))


def note_finished(it: IterationLayout, split: str, rank: int, chunks: set[int], informative: dict[int, int] | None = None) -> None:
    """``rank`` has every record of ``chunks`` fsynced in its shard (elastic, and the rounds of
    rl.filter_groups); ``informative``: per chunk, its informative groups (data/resample.py)."""
    body: dict = {"rank": rank, "chunks": sorted(chunks)}
    if informative is not None:
        body["informative"] = {str(k): n for k, n in sorted(informative.items())}
    fsio.write_record(it.done_chunks(split, rank), body)


def owners(it: IterationLayout, split: str, chunks: list[Chunk]) -> list[int | None]:
    """Each chunk's owner: the rank of its first valid claim (an invalid one is void by now:
    every rank has sealed; a claim of an adopted rank beyond what it held is void); None for
    a chunk no rank claimed."""
    adoptions = Adoptions.read(it, split)
    found: list[int | None] = []
    fsio.refresh_dir(it.claims(split))
    for chunk in chunks:
        owner, g = None, 0
        while (data := fsio.read_bytes(it.claim(split, chunk.index, g))) is not None:
            body = fsio.parse_record(data)
            if body is not None and adoptions.counts(body["rank"], chunk.index):
                owner = body["rank"]
                break
            g += 1
        found.append(owner)
    return found


# -- chunks of ranks no longer in the run -------------------------------------------------------


def all_chunks(it: IterationLayout, split: str, split_plan: dict, adoptions: Adoptions | None = None) -> list[Chunk]:
    """The plan's chunks, then those the master made of absent ranks' unfinished work."""
    adoptions = Adoptions.read(it, split) if adoptions is None else adoptions
    return chunks_of(split_plan) + list(adoptions.chunks)


def task_chunks(chunks: list[Chunk]) -> dict[int, int]:
    """Each task position's chunk: the last chunk that holds it (an adopted task moved to a new one)."""
    return {t: c.index for c in chunks for t in c.tasks}


def shard_of(it: IterationLayout, split: str, rank: int) -> Path:
    """The file that holds ``rank``'s records of ``split``: the master's copy once it adopted
    the rank, else the rank's own shard."""
    adopted = it.adopted_shard(split, rank)
    return adopted if shards.sealed(adopted) is not None else it.shard(split, rank)


def ranks_beyond(chunks: list[Chunk], owner: list[int | None], present: int) -> list[int]:
    """Ranks at or above ``present`` that hold or were given chunks (a resume on fewer nodes)."""
    return sorted({c.rank for c in chunks if c.rank >= present} | {o for o in owner if o is not None and o >= present})


def adopt(it: IterationLayout, split: str, split_plan: dict, ids: Sequence[str], *, iteration: int, ranks: Sequence[int],
          weights: Sequence[float], attempt: str) -> tuple[list[int], int]:
    """Master: take over the work of ``ranks``, no longer in the run (absent from a resumed
    run, or marked out by an elastic one). Their records are copied into sealed shards of the
    master's, their unclaimed chunks claimed for them, and the tasks they owned but had not
    written go to the ranks of positive ``weights`` as new chunks. From then on their claims
    count only for the chunks they held (``owned``, empty for a rank without work in the
    split). Ranks adopted already are skipped. Returns the ranks adopted and how many tasks moved."""
    adoptions = Adoptions.read(it, split)
    ranks = [r for r in ranks if r not in adoptions.owned]
    if not ranks:
        return [], 0
    chunks = all_chunks(it, split, split_plan, adoptions)
    owner = owners(it, split, chunks)
    for rank in ranks:
        # An invalid claim counts as void here: a live thief that wins the chunk after all is
        # its owner (the first valid generation), and the merge keeps only the owner's records.
        holder = Ledger(it, split, rank, chunks, stealing=False, settle_s=0.0, attempt=attempt, adoptions=adoptions)
        for c in chunks:
            if c.rank == rank and owner[c.index] is None:
                holder.claim(c)
        owner = owners(it, split, chunks)
    rest = []
    for rank in ranks:
        if rank not in owner:
            continue
        if shards.sealed(it.shard(split, rank)) is None and shards.sealed(it.adopted_shard(split, rank)) is None:
            # Its records so far, copied: the rank's own file keeps one writer, and whatever a
            # late process of that rank still appends to it counts for nothing.
            shards.salvage([(f"rank {rank}", it.shard(split, rank))], it.adopted_shard(split, rank), rank=rank, split=split,
                           iteration=iteration, adopted=True)
        done = set(shards.read_task_ids(shard_of(it, split, rank)))
        rest += [t for t, k in task_chunks(chunks).items() if owner[k] == rank and ids[t] not in done]
    rest.sort()
    size = max(1, split_plan.get("chunk_tasks") or len(rest))
    new = cut(split_counts(len(rest), list(weights)), size, rest, first_index=len(chunks)) if rest else []
    record = fsio.read_record(it.adopted(split)) or {"adoptions": []}
    record["adoptions"].append({"ranks": ranks, "attempt": attempt, "tasks": len(rest),
                                "owned": {str(r): [c.index for c in chunks if owner[c.index] == r] for r in ranks},
                                "chunks": [[c.index, c.rank, list(c.tasks)] for c in new]})
    fsio.write_record(it.adopted(split), record)
    return ranks, len(rest)
