"""A checkpoint directory sealed: ``orchestrator.manifest.json`` lists every file with its
size and sha256, written by the node that trains before the directory is renamed into place.
A rank verifies a checkpoint against it before serving or training from it, so a damaged
file (a bad disk, a partial copy, a bit flip) is named instead of served.
"""

from __future__ import annotations

import logging
from pathlib import Path

from orchestrator.data import shards
from orchestrator.errors import OrchestratorError
from orchestrator.protocol import fsio

log = logging.getLogger(__name__)

MANIFEST = "orchestrator.manifest.json"


class CheckpointCorrupt(OrchestratorError):
    pass


def seal(directory: Path) -> dict:
    """Write the manifest of every file under ``directory`` (the weights at the top, the
    optimizer state in ``optimizer/``), keyed by its path relative to ``directory``. Raises
    CheckpointCorrupt when a safetensors index names a file that is not there (shards come
    from every train worker's node: one that is not visible here yet is waited for briefly)."""
    _shards_present(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory)
        if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in rel.parts):
            files[rel.as_posix()] = {"bytes": p.stat().st_size, "sha256": shards.sha256_file(p)}
    body = {"files": files}
    fsio.write_record(directory / MANIFEST, body)
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


def verify(directory: Path) -> None:
    """Raise CheckpointCorrupt naming the first file that does not match the manifest."""
    manifest = fsio.read_record(directory / MANIFEST)
    if manifest is None:
        raise CheckpointCorrupt(
            f"checkpoint {directory} has no valid {MANIFEST} (missing or damaged): it cannot be trusted. "
            f"Restore the directory from a copy, or see docs/reliability.md, \"corrupted checkpoint\""
        )
    for name, want in manifest["files"].items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint {directory} lacks {name}, which its manifest lists") from None
        got = shards.sha256_file(path) if size == want["bytes"] else None
        if got != want["sha256"]:
            what = f"{size} bytes, expected {want['bytes']}" if got is None else f"sha256 {got[:12]}, expected {want['sha256'][:12]}"
            raise CheckpointCorrupt(
                f"checkpoint file {path} is damaged ({what}). Restore it from a copy, or see docs/reliability.md, "
                f"\"corrupted checkpoint\""
            )


class Verified:
    """Verify each checkpoint once per process (verification hashes every file)."""

    def __init__(self) -> None:
        self._ok: set[Path] = set()

    def check(self, directory: Path) -> None:
        if directory in self._ok:
            return
        verify(directory)
        log.info("checkpoint %s matches its manifest", directory)
        self._ok.add(directory)
