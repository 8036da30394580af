"""The version a node's engines serve, rebuilt on the node (``publish.delta``): read from the
shared filesystem once per node, checked, written into a node-local directory
(``rollout.local_cache``), and only then handed to the engines, which read it there.

A version is rebuilt, in this order of preference:

1. from the version the node holds plus the deltas after it (the usual move: only the new
   delta is read);
2. from the last full copy plus the chain of deltas after it (a node that is behind, or was
   restarted: its local directory starts empty);
3. from the version's own master weights (``master/``, fp32, where its training state was
   written), cast to the published dtype and checked against the delta's sums.

Every file read is checked against its checkpoint's manifest as it is read, and every tensor
a delta rebuilds against the sum of its values: a damaged or missing file makes the next way
be tried (with a warning naming it), and when none is left the error names it. A version is
handed out only whole: it is built beside the others and renamed into place. The versions the
engines no longer serve are removed as soon as the new one is in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.checkpoints import deltas, manifest, sharded, sums
from orchestrator.checkpoints.files import MASTER_DIR
from orchestrator.checkpoints.manifest import CheckpointCorrupt
from orchestrator.checkpoints.store import Checkpoint
from orchestrator.protocol.layout import RunLayout

log = logging.getLogger(__name__)

_RUN_ONLY = {manifest.MANIFEST, "train_stats.json", deltas.INDEX}


@dataclass(frozen=True, slots=True)
class Built:
    """How a version came to be on the node: its directory, the way taken, the bytes read
    from the shared filesystem and the seconds it took."""

    path: Path
    how: str
    bytes_read: int
    seconds: float


class NodeCopies:
    """One process's rebuilt versions, in a directory of its own under ``root``
    (``p<pid>-*``), removed by :meth:`close`; a directory a process that is gone left is removed
    at the start (a copy a crash left cannot be trusted: it is rebuilt from the shared
    checkpoints). Its own, so that no other process's start or close removes what it builds;
    after :meth:`close` it may be used again, starting empty (a rank that rejoins its run,
    elastic, closes its work first and goes on)."""

    def __init__(self, layout: RunLayout, root: Path):
        self.layout = layout
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        for old in base.iterdir():
            if not _alive(old.name):
                shutil.rmtree(old, ignore_errors=True)
        self.root = Path(tempfile.mkdtemp(prefix=f"p{os.getpid()}-", dir=base))
        self.held: tuple[int, Path] | None = None
        self.last: Built | None = None
        self._read = 0
        self._manifests: dict[Path, dict] = {}

    def get(self, checkpoint: Checkpoint, before_place=None) -> Path:
        """The node-local directory of ``checkpoint`` (a version the run published), rebuilt
        when the node does not hold it. Raises CheckpointCorrupt naming the file at fault.
        ``before_place()`` runs once it is built, before it is renamed into place (a test's
        fault point)."""
        if self.held is not None and self.held[0] == checkpoint.iteration:
            return self.held[1]
        began, target = time.monotonic(), checkpoint.iteration
        self.root.mkdir(parents=True, exist_ok=True)  # again after close(): a rank that rejoins (elastic) goes on with it
        failures = []
        self._manifests = {}  # read afresh for each rebuild, once per checkpoint
        ways = [(f"copied from the base model {checkpoint.path}", lambda staging: self._copy_base(checkpoint.path, staging))] \
            if checkpoint.is_base else self._ways(target)
        for how, build in ways:
            self._read = 0
            staging = self.root / f".building-{target}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            try:
                build(staging)
            except (CheckpointCorrupt, deltas.DeltaError, FileNotFoundError) as e:
                shutil.rmtree(staging, ignore_errors=True)
                failures.append(f"{how}: {e}")
                log.warning("could not rebuild iteration %d's weights %s (%s); trying the next way", target, how, e)
                continue
            if before_place is not None:
                before_place()
            final = self.root / f"iter-{target}"
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            self._retire(keep=final)
            self.held = (target, final)
            self.last = Built(final, how, self._read, round(time.monotonic() - began, 4))
            log.info("iteration %d's weights rebuilt in %s %s: %d bytes read from %s in %.2f s", target, final, how, self._read,
                     checkpoint.path if checkpoint.is_base else self.layout.checkpoints, self.last.seconds)
            return final
        raise CheckpointCorrupt(f"the weights of iteration {target} cannot be rebuilt on this node: " + "; ".join(failures)
                                + ". Restore the file named from a copy, or see docs/reliability.md, \"corrupted checkpoint\"")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.held = None
        with contextlib.suppress(OSError):
            self.root.parent.rmdir()  # the run's and rank's directory, once no process has one in it

    # -- the ways ---------------------------------------------------------------------------------

    def _ways(self, target: int):
        """(how, build) in the order they are tried; ``build(staging)`` writes the version there."""
        source = self.layout.checkpoint(target)
        if self.held is not None:
            held, path = self.held
            chain = self._chain(target, held)
            if held in chain[:-1]:
                after = chain[chain.index(held) + 1:]
                yield (f"from iteration {held}, which it held, and {len(after)} delta(s)",
                       lambda staging: self._apply(staging, sharded.read_all(path), after, source))
        chain = self._chain(target, None)  # read only when the node held nothing to move from, or that failed
        full = next((v for v in reversed(chain) if v and deltas.is_whole(self.layout.checkpoint(v))), None)
        if full is not None:
            after = chain[chain.index(full) + 1:]
            yield (f"from the full copy of iteration {full}" + (f" and {len(after)} delta(s)" if after else ""),
                   lambda staging: self._from_full(staging, full, after, source))
        if full != target and (source / MASTER_DIR).is_dir():
            yield f"from iteration {target}'s master weights", lambda staging: self._from_master(staging, target)

    def _chain(self, target: int, held: int | None) -> list[int]:
        """The versions ``target`` is rebuilt along, oldest first: back along each delta's base
        to ``held`` (the version the node holds) or to the newest full copy, whichever comes
        first (as far as they can be found: a missing one ends it, and the ways that need it
        then fail). The base model (0) is followed only to a node that holds it."""
        chain = [target]
        while chain[0] != held or len(chain) == 1:
            directory = self.layout.checkpoint(chain[0])
            whole = deltas.is_whole(directory)
            if (whole and len(chain) > 1) or not deltas.is_delta(directory):
                return chain
            try:
                base = deltas.read_index(directory, self._read_checked(directory, deltas.INDEX))["base"]
            except (CheckpointCorrupt, deltas.DeltaError) as e:
                log.warning("%s", e)
                return chain
            if base in chain or (whole and base != held) or (base == 0 and held != 0) or \
                    (base and not self.layout.checkpoint(base).is_dir()):
                return chain
            chain.insert(0, base)
        return chain

    def _copy_base(self, base: Path, staging: Path) -> None:
        """The base model as it is (no manifest: the user's), so that the first version's
        delta applies to the bits the engines serve."""
        for p in sorted(Path(base).iterdir()):
            if p.is_file() and not p.name.startswith("."):
                self._read += sums.copy_file(p, staging / p.name).size

    def _from_full(self, staging: Path, full: int, after: list[int], source: Path) -> None:
        scratch = self.root / f".full-{full}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        try:
            self._copy_weights(self.layout.checkpoint(full), scratch)
            tensors = sharded.read_all(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._apply(staging, tensors, after, source)

    def _apply(self, staging: Path, tensors: dict, versions: list[int], source: Path) -> None:
        """``tensors`` moved through the deltas of ``versions`` (each checked), written as
        ``source``'s version (one file, whatever the shards it came from), with its small files."""
        for version in versions:
            tensors = self._delta(self.layout.checkpoint(version), tensors)
        self._write(staging, tensors, source)

    def _delta(self, directory: Path, tensors: dict) -> dict:
        index = deltas.read_index(directory, self._read_checked(directory, deltas.INDEX))
        out = {}
        for name in sorted(set(index["weight_map"].values())):
            out.update(deltas.decode_file(directory / name, self._read_checked(directory, name), tensors))
        missing = sorted(set(index["weight_map"]) - set(out))
        if missing:
            raise deltas.DeltaError(f"delta of {directory} does not rebuild {missing[:3]}")
        return out

    def _from_master(self, staging: Path, target: int) -> None:
        """The fp32 master weights of ``target``, checked against the manifest as they are
        read, cast to the published dtype (a cast is exact: the trainer published the same)."""
        import torch

        directory = self.layout.checkpoint(target)
        index = deltas.read_index(directory, self._read_checked(directory, deltas.INDEX))
        master, tensors = directory / MASTER_DIR, {}
        for p in sorted(master.iterdir()):
            if p.name.endswith(".safetensors"):
                tensors.update(_load(self._read_checked(directory, f"{MASTER_DIR}/{p.name}")))
        dtype = getattr(torch, index["dtype"])
        missing = sorted(set(index["weight_map"]) - set(tensors))
        if missing:
            raise CheckpointCorrupt(f"{master} lacks {missing[:3]}")
        self._write(staging, {n: tensors[n].to(dtype) for n in index["weight_map"]}, directory)

    # -- files ------------------------------------------------------------------------------------

    def _write(self, staging: Path, tensors: dict, source: Path) -> None:
        sums.write_safetensors(staging / "model.safetensors", tensors, {"format": "pt"}, durable=False)
        self._copy_small(source, staging)

    def _copy_weights(self, directory: Path, into: Path) -> None:
        """A full copy's weights (one file, or shards and their index), each checked against
        the manifest as it is copied."""
        for p in sorted(directory.iterdir()):
            if p.is_file() and ((p.name.startswith("model") and p.name.endswith(".safetensors")) or p.name == sharded.WEIGHTS_INDEX):
                self._copy_checked(directory, p.name, into / p.name)

    def _copy_small(self, directory: Path, into: Path) -> None:
        """The config, generation config and tokenizer files, checked: from the version the
        node holds where its file has the sum the manifest lists (the tokenizer, megabytes,
        rarely changes), else from the shared filesystem."""
        held = self.held[1] if self.held is not None else None
        for p in sorted(directory.iterdir()):
            weights = p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")
            if not p.is_file() or weights or p.name in _RUN_ONLY or p.name.startswith("."):
                continue
            if held is not None and _same(held / p.name, self._expected(directory, p.name)):
                shutil.copyfile(held / p.name, into / p.name)
            else:
                (into / p.name).write_bytes(self._read_checked(directory, p.name))

    def _expected(self, directory: Path, name: str) -> dict:
        """``name``'s manifest entry; each manifest is read once per rebuild."""
        if directory not in self._manifests:
            self._manifests[directory] = manifest.listed(directory)
        want = self._manifests[directory].get(name)
        if want is None:
            raise CheckpointCorrupt(f"checkpoint {directory}: its manifest does not list {name}")
        return want

    def _read_checked(self, directory: Path, name: str) -> bytes:
        """``name``'s bytes, checked against ``directory``'s manifest (one read)."""
        want, path = self._expected(directory, name), directory / name
        data = path.read_bytes()  # FileNotFoundError: a missing file, which the caller names
        self._read += len(data)
        manifest.check(path, len(data), want, lambda used: manifest.digest_of(data, used))
        return data

    def _copy_checked(self, directory: Path, name: str, target: Path) -> None:
        want, path = self._expected(directory, name), directory / name
        copied = sums.copy_file(path, target)
        self._read += copied.size
        manifest.check(path, copied.size, want,
                       lambda used: copied.digest if used == sums.ALGORITHM else manifest.digest_of(target.read_bytes(), used))

    def _retire(self, keep: Path) -> None:
        for p in self.root.iterdir():
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)


def _alive(name: str) -> bool:
    """Whether the process a cache directory ``p<pid>-*`` is named by still runs (any other
    name: left by an older version, not alive)."""
    pid = name[1:].split("-", 1)[0] if name.startswith("p") else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same(local: Path, want: dict) -> bool:
    """Whether the node-local file ``local`` is the one the manifest entry ``want`` lists."""
    try:
        manifest.check_file(local, want)
    except (OSError, CheckpointCorrupt):
        return False
    return True


def _load(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)
