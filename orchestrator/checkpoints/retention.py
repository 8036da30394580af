"""Checkpoint retention: which iteration checkpoints the master removes after an iteration,
the consumer markers that keep a checkpoint someone may still load, and a removal that a
crash cannot leave half done.

Kept, whatever ``checkpoint.keep_last`` and ``checkpoint.keep_every`` say: the current
checkpoint (``current.json``), any newer one, and every checkpoint a consumer marker names.
``checkpoints/consumers/r<R>.json`` is rank R's marker (R is its only writer): the checkpoint
its engines or trainers last loaded, written before they load it. prime-rl deleted a
weights directory while an inference server was loading it; the marker is how a reader says
"not this one". Which readers it protects and which it does not: docs/protocol.md,
"Checkpoint retention".

A removal renames ``iter-<I>`` to ``.trash-iter-<I>.<hex>`` (atomic: a reader finds the
whole checkpoint or none), fsyncs ``checkpoints/``, then deletes the trash. A crash between
the two leaves only trash, a dot name nothing reads, which the next prune deletes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from orchestrator.checkpoints import deltas
from orchestrator.checkpoints.files import has_state
from orchestrator.checkpoints.store import Checkpoint
from orchestrator.node import identity
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import TRASH_PREFIX, RunLayout, checkpoint_iteration


def mark_consumer(layout: RunLayout, rank: int, checkpoint_path: Path) -> None:
    """Say that rank ``rank`` loads ``checkpoint_path`` now: call it before loading. The
    marker names only the latest checkpoint; it is rewritten when that, or the process, changes."""
    name = _name(layout, checkpoint_path)
    marker = layout.checkpoint_consumer(rank)
    me = identity.me()
    old = fsio.read_record(marker)
    if old is not None and (old.get("checkpoint"), old.get("host"), old.get("pid")) == (name, me["host"], me["pid"]):
        return
    fsio.write_record(marker, {"rank": rank, "checkpoint": name, **me, "at": time.time()})


@dataclass(frozen=True, slots=True)
class Decision:
    keep: dict[int, list[str]]
    """Each kept iteration and why (``current``, ``keep_last=3``, ``consumer r00001.json``, ...)."""
    remove: list[int]


def decide(present: Iterable[int], current: int, keep_last: int, keep_every: int,
           consumers: Mapping[int, list[str]], bases: Mapping[int, int] | None = None, states: Iterable[int] | None = None) -> Decision:
    """Which of the checkpoints ``present`` (their iterations) to keep, and why, and which to
    remove: the newest ``keep_last`` up to ``current`` (it among them), every one divisible
    by ``keep_every`` (if not 0), any newer than ``current``, those ``consumers`` name, and
    the chain each kept one's weights are rebuilt from (``bases``: iteration -> the version
    its weights are a delta against, publish.delta), and, when ``states`` (the iterations
    whose checkpoint holds the training state) is given, the newest of them up to
    ``current``: a trainer replays from it (checkpoint.state_every)."""
    why: dict[int, list[str]] = {i: [] for i in sorted(set(present))}
    newest = [i for i in why if i <= current][-keep_last:]
    for i, reasons in why.items():
        if i == current:
            reasons.append("current")
        elif i > current:
            reasons.append("newer than current")
        if i in newest:
            reasons.append(f"keep_last={keep_last}")
        if keep_every and i % keep_every == 0:
            reasons.append(f"keep_every={keep_every}")
        reasons.extend(f"consumer {name}" for name in consumers.get(i, ()))
    if states is not None and (replay_from := max((i for i in states if i <= current and i in why), default=None)) is not None:
        if not why[replay_from]:
            why[replay_from].append("state to replay from")
    for i in [i for i, r in why.items() if r]:
        j = (bases or {}).get(i)
        while j is not None and j in why and f"chain of {i}" not in why[j]:
            why[j].append(f"chain of {i}")
            j = bases.get(j)
    return Decision(keep={i: r for i, r in why.items() if r}, remove=[i for i, r in why.items() if not r])


def prune(layout: RunLayout, current: Checkpoint, keep_last: int, keep_every: int, log: logging.Logger, *, ranks: int = 1,
          before_delete: Callable[[Path], None] | None = None) -> list[int]:
    """Master, once every engine serves the ``current`` checkpoint (the published policy;
    nothing is removed while it is the base model): delete what an earlier removal left, then
    remove the checkpoints :func:`decide` does not keep; return their iterations.

    ``ranks``: the run's ranks, whose markers are read by name (a directory listing may lag);
    other markers in ``consumers/`` count too. A marker that exists but does not validate
    stops every removal this time (it may name anything). ``before_delete(trash)`` runs
    between the rename and the delete (a test's fault point). An ``OSError`` while moving or
    deleting is logged and left to the next prune: a failed removal never fails the run."""
    fsio.refresh_dir(layout.checkpoints)
    try:
        names = os.listdir(layout.checkpoints)
    except FileNotFoundError:
        return []
    for name in sorted(n for n in names if n.startswith(TRASH_PREFIX)):
        if _delete(layout.checkpoints / name, log):
            log.info("deleted %s, left by a removal that was cut short", name)
    if current.is_base:
        return []
    consumers = _consumers(layout, ranks, log)
    if consumers is None:
        return []
    present = [i for i in map(checkpoint_iteration, names) if i is not None]
    try:
        bases = {i: deltas.base_of(layout.checkpoint(i)) for i in present if deltas.needs_base(layout.checkpoint(i))}
    except deltas.DeltaError as e:
        log.warning("%s: no checkpoint is removed this time (the chain it belongs to is not known)", e)
        return []
    named = _iteration(layout, _name(layout, current.path))
    states = [i for i in present if has_state(layout.checkpoint(i))]
    decision = decide(present, current.iteration if named is None else named, keep_last, keep_every, consumers, bases, states)
    if not decision.remove:
        return []
    log.info("removing the checkpoints of iteration(s) %s; keeping %s", ", ".join(map(str, decision.remove)),
             ", ".join(f"{i} ({', '.join(r)})" for i, r in decision.keep.items()))
    removed = []
    for iteration in decision.remove:
        source, trash = layout.checkpoint(iteration), layout.checkpoint_trash(iteration, uuid.uuid4().hex[:8])
        try:
            os.rename(source, trash)
        except FileNotFoundError:
            continue  # the listing was older than the directory
        except OSError as e:
            log.warning("could not move checkpoint %s aside to remove it (%s): it stays, the next iteration tries again", source, e)
            continue
        fsio.fsync_dir(layout.checkpoints)
        removed.append(iteration)
        if before_delete is not None:
            before_delete(trash)
        _delete(trash, log)
    return removed


def _consumers(layout: RunLayout, ranks: int, log: logging.Logger) -> dict[int, list[str]] | None:
    """Iteration -> the markers naming it; None when a marker exists but cannot be read."""
    directory = layout.checkpoint_consumers
    fsio.refresh_dir(directory)
    markers = {layout.checkpoint_consumer(r) for r in range(ranks)}
    try:
        markers |= {directory / n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith(".")}
    except FileNotFoundError:
        pass
    pinned: dict[int, list[str]] = {}
    for marker in sorted(markers):
        if fsio.read_bytes(marker) is None:
            continue
        body = fsio.read_record(marker)
        if body is None or not isinstance(body.get("checkpoint"), str):
            log.warning("consumer marker %s does not validate (half written, or damaged): no checkpoint is removed this "
                        "time. If no reader writes it, delete it", marker)
            return None
        iteration = _iteration(layout, body["checkpoint"])
        if iteration is not None:
            pinned.setdefault(iteration, []).append(marker.name)
    return pinned


def _name(layout: RunLayout, path: Path) -> str:
    """How a marker names ``path``: relative to the log path when inside it (the same on every node)."""
    path = Path(path)
    return str(path.relative_to(layout.root)) if path.is_relative_to(layout.root) else str(path)


def _iteration(layout: RunLayout, name: str) -> int | None:
    """The iteration of the checkpoint directory ``name`` (as ``_name`` writes it) names, if it names one."""
    path = layout.root / name  # an absolute name stays as it is
    return checkpoint_iteration(path.name) if path.parent == layout.checkpoints else None


def _delete(path: Path, log: logging.Logger) -> bool:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return False
    except OSError as e:  # NFS: a file another client holds open stays as .nfsXXXX until it is closed
        log.warning("could not delete %s (%s): the next iteration tries again", path, e)
        return False
    return True
