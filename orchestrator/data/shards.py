"""Trajectory shards: JSON lines appended incrementally, sealed with a manifest, merged by
streaming.

A shard has one writer (its rank). Records are appended in small batches, each flushed and
fsynced, so a crash loses at most the batch in flight. A restarted writer keeps every
complete line, cuts a torn last line, and skips the task ids the shard already holds.
Sealing writes ``<shard>.manifest.json`` (count, bytes, sha256); a reader trusts a shard
only when the file matches its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from orchestrator.errors import OrchestratorError
from orchestrator.protocol import fsio


class ShardError(OrchestratorError):
    """A shard or aggregate does not match its manifest."""


def iter_valid_lines(path: Path) -> Iterator[tuple[int, bytes, dict]]:
    """(end offset, raw line, record) for each complete, parsable line; stops at the first bad one."""
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return
            try:
                record = json.loads(raw)
            except ValueError:
                return
            if not isinstance(record, dict) or "task_id" not in record:
                return
            offset += len(raw)
            yield offset, raw, record


class ShardWriter:
    """Appends records to a shard; reopening resumes after the last complete record."""

    def __init__(self, path: Path, batch: int = 16, mark: Callable[[dict], bool] | None = None):
        """``mark(record)``: which records' task ids :attr:`marked` keeps (those already in the
        shard included)."""
        self.path = path
        self.batch = batch
        self.mark = mark
        self.task_ids: set[str] = set()
        self.marked: set[str] = set()
        path.parent.mkdir(parents=True, exist_ok=True)
        good = 0
        if path.exists():
            for good, _raw, record in iter_valid_lines(path):
                self._add(record)
        self._f = open(path, "ab")
        self._f.truncate(good)
        self._pending = 0

    def _add(self, record: dict) -> None:
        self.task_ids.add(record["task_id"])
        if self.mark is not None and self.mark(record):
            self.marked.add(record["task_id"])

    def append(self, record: dict) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._add(record)
        self._pending += 1
        if self._pending >= self.batch:
            self.flush()

    def flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._pending = 0

    def close(self) -> None:
        self.flush()
        self._f.close()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Manifest:
    count: int
    bytes: int
    sha256: str
    extra: dict

    def to_json(self) -> dict:
        return {"count": self.count, "bytes": self.bytes, "sha256": self.sha256, **self.extra}

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        extra = {k: v for k, v in d.items() if k not in ("count", "bytes", "sha256")}
        return cls(d["count"], d["bytes"], d["sha256"], extra)


def manifest_path(shard: Path) -> Path:
    return shard.with_name(shard.name.removesuffix(".jsonl") + ".manifest.json")


def seal(shard: Path, **extra) -> Manifest:
    """Write the manifest of a finished shard (idempotent: a matching seal is kept)."""
    existing = read_manifest(shard)
    if existing is not None and verify(shard, existing):
        return existing
    count, h, size = 0, hashlib.sha256(), 0
    if shard.exists():
        for _end, raw, _rec in iter_valid_lines(shard):
            count += 1
            h.update(raw)
            size += len(raw)
        if size != shard.stat().st_size:
            raise ShardError(f"{shard} has a torn or invalid line after byte {size}; reopen it with ShardWriter to repair")
    else:
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.touch()
    manifest = Manifest(count, size, h.hexdigest(), extra)
    fsio.write_record(manifest_path(shard), manifest.to_json())
    return manifest


def read_manifest(shard: Path) -> Manifest | None:
    body = fsio.read_record(manifest_path(shard))
    return Manifest.from_json(body) if body else None


def sealed(shard: Path) -> Manifest | None:
    """The manifest if the shard is sealed and its size matches (cheap check, no hashing)."""
    m = read_manifest(shard)
    if m is None:
        return None
    try:
        return m if shard.stat().st_size == m.bytes else None
    except FileNotFoundError:
        return None


def verify(shard: Path, m: Manifest) -> bool:
    """Every byte of ``shard`` matches ``m`` (size, then sha256)."""
    try:
        return shard.stat().st_size == m.bytes and sha256_file(shard) == m.sha256
    except FileNotFoundError:
        return False


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def merge(sources: Iterable[tuple[str, Path]], dest: Path, keep: Callable[[str, dict], bool] | None = None,
          order: Callable[[dict], int] | None = None, **extra) -> Manifest:
    """Stream sealed shards into ``dest`` (temp + rename), verifying each against its
    manifest on the way; memory stays at one line. ``sources`` is (label, shard) pairs;
    the label (e.g. "rank 2") names the culprit of a bad checksum. ``keep(label, record)``:
    whether a record counts (a chunk's records count from its owner only, data/claims.py);
    the others are left out and counted as ``dropped``. ``order(record)``: its position in
    the aggregate (the plan's task order), so that the aggregate is the same bytes whichever
    rank did which task; records that do not come in that order are put in it by a second
    pass over the merged file.

    Returns the aggregate's manifest, with per-source counts and the task ids seen once
    each (duplicates raise).
    """
    return _merge(sources, dest, _sealed_lines, extra, keep, order)


def salvage(sources: Iterable[tuple[str, Path]], dest: Path, keep: Callable[[str, dict], bool] | None = None, **extra) -> Manifest:
    """Like :func:`merge`, for what survived a crash: every complete record of every shard,
    sealed or not (an unsealed shard up to its first torn or invalid line; an absent one adds
    nothing), that ``keep`` keeps. The manifest says ``partial: true`` and, per source, whether
    it was sealed."""
    sources = list(sources)
    states = {label: ("sealed" if sealed(shard) else "partial" if shard.exists() else "absent") for label, shard in sources}
    return _merge(sources, dest, _surviving_lines, {**extra, "partial": True, "source_state": states}, keep)


def _sealed_lines(label: str, shard: Path) -> Iterator[tuple[bytes, dict]]:
    m = read_manifest(shard)
    if m is None:
        raise ShardError(f"{label}: shard {shard} is not sealed (no valid manifest)")
    sh, n = hashlib.sha256(), 0
    with open(shard, "rb") as f:
        for raw in f:
            sh.update(raw)
            try:
                record = json.loads(raw)
                record["task_id"]
            except (ValueError, KeyError, TypeError):
                raise ShardError(f"{label}: shard {shard} has an invalid record after record {n}") from None
            yield raw, record
            n += 1
    if sh.hexdigest() != m.sha256 or n != m.count:
        raise ShardError(
            f"{label}: shard {shard} does not match its manifest "
            f"(sha256 {sh.hexdigest()[:12]} vs {m.sha256[:12]}, {n} vs {m.count} records); "
            f"delete the shard and its manifest to regenerate it"
        )


def _surviving_lines(label: str, shard: Path) -> Iterator[tuple[bytes, dict]]:
    if shard.exists():
        for _end, raw, record in iter_valid_lines(shard):
            yield raw, record


def _merge(sources: Iterable[tuple[str, Path]], dest: Path, lines, extra: dict, keep=None, order=None) -> Manifest:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    placed: list[tuple[int, int, int]] = []  # (position, offset, length) of each record written, with ``order``
    seen: set[str] = set()
    counts: dict[str, int] = {}
    total, trajectories, h, size, dropped = 0, 0, hashlib.sha256(), 0, 0
    reward_errors, first_error, rewarded = 0, None, 0
    policies: set[int] = set()
    try:
        with open(tmp, "wb") as out:
            for label, shard in sources:
                n = 0
                for raw, record in lines(label, shard):
                    if keep is not None and not keep(label, record):
                        dropped += 1
                        continue
                    if record["task_id"] in seen:
                        raise ShardError(f"{label}: task {record['task_id']} appears twice (in {shard})")
                    seen.add(record["task_id"])
                    trajectories += len(record.get("samples") or [record])
                    if isinstance(record.get("policy_iteration"), int):
                        policies.add(record["policy_iteration"])
                    for sample in record.get("samples") or []:
                        if isinstance(sample, dict) and sample.get("reward") not in (None, 0):
                            rewarded += 1
                        if isinstance(sample, dict) and sample.get("reward_error"):
                            reward_errors += 1
                            first_error = first_error or {"task_id": record["task_id"], "error": sample["reward_error"]}
                    if order is not None:
                        placed.append((order(record), size, len(raw)))
                    out.write(raw)
                    h.update(raw)
                    size += len(raw)
                    n += 1
                counts[label] = n
                total += n
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if any(a[0] > b[0] for a, b in zip(placed, placed[1:])):
            digest = _reorder(tmp, sorted(placed))
        os.replace(tmp, dest)
        fsio.fsync_dir(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # A record is one task; its trajectories are its samples (a record without samples is one).
    # Samples whose reward failed (scored 0) are counted, with the first one's error, and those
    # whose reward is not 0 (``rewarded``: none at all says the reward may not fit the tasks); the
    # checkpoints the records came from as [oldest, newest] (data/staleness.py).
    manifest = Manifest(total, size, digest, {"per_source": counts, "trajectories": trajectories, "dropped": dropped,
                                                     "reward_errors": reward_errors, "first_reward_error": first_error,
                                                     "rewarded": rewarded,
                                                     "policy_iterations": [min(policies), max(policies)] if policies else None,
                                                     **extra})
    fsio.write_record(manifest_path(dest), manifest.to_json())
    return manifest


def _reorder(path: Path, placed: list[tuple[int, int, int]]) -> str:
    """Rewrite ``path`` with its records at (offset, length) in the order ``placed`` lists
    them (temp + rename in the same directory); returns the sha256 of the new content."""
    tmp = path.with_name(path.name + ".ordered")
    h = hashlib.sha256()
    try:
        with open(path, "rb") as src, open(tmp, "wb") as out:
            for _pos, offset, length in placed:
                src.seek(offset)
                raw = src.read(length)
                out.write(raw)
                h.update(raw)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return h.hexdigest()


def read_task_ids(path: Path) -> list[str]:
    return [rec["task_id"] for _end, _raw, rec in iter_valid_lines(path)]
