"""A checkpoint directory sealed: ``orchestrator.manifest.json`` lists every file with its
size and checksum, written by the node that trains before the directory is renamed into place.

The sums come from the writers, computed as they wrote (sums.py), the files a library wrote
(configs, tokenizer) included: sealing checks each summed file's size and reads none of them;
a file no writer summed is summed here. A reader verifies what it reads against the manifest, and only
that: an engine the weights (``WEIGHTS``: the files at the top level), a trainer that loads the
checkpoint all of it (``ALL``: the optimizer state too). A damaged file (a bad disk, a partial
copy, a bit flip) is named instead of served. Manifests of older runs name sha256: still read.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from orchestrator.checkpoints import deltas, sums
from orchestrator.data import shards
from orchestrator.errors import OrchestratorError
from orchestrator.protocol import fsio

log = logging.getLogger(__name__)

MANIFEST = "orchestrator.manifest.json"
WEIGHTS = "weights"
"""What an engine reads: the files at the checkpoint's top level (weights, config, tokenizer)."""
ALL = "all"


class CheckpointCorrupt(OrchestratorError):
    pass


def seal(directory: Path) -> dict:
    """Write the manifest of every file under ``directory`` (the weights at the top, the
    optimizer state in ``optimizer/``), keyed by its path relative to ``directory``: the sums
    its writers recorded, each file's size checked; a file no writer summed is summed here.
    Raises CheckpointCorrupt when a safetensors index names a file that is not there (shards
    come from every train worker's node: one that is not visible here yet is waited for
    briefly), or when a file's size is not what its writer wrote."""
    _shards_present(directory)
    written = sums.gathered(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory)
        if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in rel.parts):
            size = p.stat().st_size
            entry = written.get(rel.as_posix())
            if entry is None:
                entry = {"bytes": size, sums.ALGORITHM: sums.file_sum(p)}
            elif entry["bytes"] != size:
                raise CheckpointCorrupt(f"checkpoint file {p} has {size} bytes where its writer wrote {entry['bytes']}: "
                                        f"a write was cut short or the file was changed since")
            files[rel.as_posix()] = entry
    body = {"files": files}
    if deltas.INDEX in files:  # the weights are a delta: the version they apply to (deltas.py)
        body["delta_base"] = deltas.base_of(directory)
    fsio.write_record(directory / MANIFEST, body)
    shutil.rmtree(directory / sums.DIRECTORY, ignore_errors=True)  # gathered into the manifest
    return body


def _shards_present(directory: Path, wait_s: float = 30.0) -> None:
    import json

    from orchestrator.errors import DeadlineExceeded
    from orchestrator.protocol.waiting import Backoff, Deadline, poll

    for index in sorted(directory.rglob("*.safetensors.index.json")):
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))

        def missing() -> list[str]:
            fsio.refresh_dir(index.parent)
            return [n for n in names if not (index.parent / n).is_file()]

        try:
            poll(lambda: True if not missing() else None, deadline=Deadline.after(wait_s, f"the shards {index.name} names"),
                 backoff=Backoff(0.05, 2.0))
        except DeadlineExceeded:
            raise CheckpointCorrupt(f"checkpoint {directory}: {index.name} names {', '.join(missing())}, which are not there: a train "
                                    f"worker's shard was not written or is not visible from this node") from None


def listed(directory: Path) -> dict[str, dict]:
    """The files ``directory``'s manifest lists (name -> its bytes and sum). Raises
    CheckpointCorrupt when there is no valid manifest."""
    manifest = fsio.read_record(directory / MANIFEST)
    if manifest is None:
        raise CheckpointCorrupt(
            f"checkpoint {directory} has no valid {MANIFEST} (missing or damaged): it cannot be trusted. "
            f"Restore the directory from a copy, or see docs/reliability.md, \"corrupted checkpoint\""
        )
    return manifest["files"]


def algorithm(want: dict) -> str:
    """The checksum a manifest entry records: xxh3-128, or sha256 in an older run's."""
    return sums.ALGORITHM if sums.ALGORITHM in want else "sha256"


def check(path: Path, size: int, want: dict, digest) -> None:
    """Raise CheckpointCorrupt naming ``path`` unless its ``size`` and its sum (``digest(algorithm)``,
    asked for only when the size matches) are those of ``want``, its manifest entry."""
    used = algorithm(want)
    got = digest(used) if size == want["bytes"] else None
    if got != want[used]:
        what = f"{size} bytes, expected {want['bytes']}" if got is None else f"{used} {got[:12]}, expected {want[used][:12]}"
        raise CheckpointCorrupt(f"checkpoint file {path} is damaged ({what}). Restore it from a copy, or see docs/reliability.md, "
                                f"\"corrupted checkpoint\"")


def digest_of(data: bytes, used: str) -> str:
    """``data``'s sum by the manifest's ``used`` algorithm."""
    if used == sums.ALGORITHM:
        h = sums.hasher()
        h.update(data)
        return h.hexdigest()
    import hashlib

    return hashlib.sha256(data).hexdigest()


def check_file(path: Path, want: dict) -> None:
    """``check`` of the file at ``path`` (its size, then its sum read from it)."""
    check(path, path.stat().st_size, want, lambda used: sums.file_sum(path) if used == sums.ALGORITHM else shards.sha256_file(path))


def verify(directory: Path, part: str = ALL) -> None:
    """Raise CheckpointCorrupt naming the first file of ``part`` (``WEIGHTS`` or ``ALL``) that
    does not match the manifest."""
    for name, want in listed(directory).items():
        if part == WEIGHTS and "/" in name:
            continue  # the optimizer state: the trainer's, not the engine's
        try:
            check_file(directory / name, want)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint {directory} lacks {name}, which its manifest lists") from None


class Verified:
    """Verify each part of a checkpoint once per process (verification reads every file of it)."""

    def __init__(self) -> None:
        self._ok: set[tuple[Path, str]] = set()

    def check(self, directory: Path, part: str = ALL) -> None:
        if (directory, part) in self._ok or (directory, ALL) in self._ok:
            return
        verify(directory, part)
        log.info("checkpoint %s matches its manifest%s", directory, " (its weights: what the engines read)" if part == WEIGHTS else "")
        self._ok.add((directory, part))
