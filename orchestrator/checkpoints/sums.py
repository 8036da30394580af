"""Checksums of a checkpoint's files, computed as their bytes are written, never by reading a
file back: the train worker that writes a file hashes each buffer it writes (xxh3-128, the
``xxhash`` package: tens of GB/s a core, against sha256's one or two; no adversary writes a
run's checkpoints) and keeps the sum in its own record, ``.sums/<writer>.json`` beside the
files. The manifest (manifest.py) gathers those records and checks each file's size, so
sealing a checkpoint reads none of its large files.

Safetensors files are written here as a stream (``save_safetensors``): the format's header,
then each tensor's bytes straight from its memory, so a writer holds no second copy of a
file (the ``safetensors`` package's own ``save`` builds the whole file in memory first). The
files are read with the ``safetensors`` package like any other.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.protocol import fsio

ALGORITHM = "xxh3_128"
DIRECTORY = ".sums"
"""Per-writer records of the sums, in the checkpoint directory (hidden: not in the manifest)."""
CHUNK = 16 << 20

_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def hasher():
    import xxhash

    return xxhash.xxh3_128()


def file_sum(path: Path) -> str:
    """The checksum of a file's bytes, read in chunks (to verify a file, or to sum a small file
    a library wrote)."""
    h = hasher()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(slots=True)
class Sums:
    """The files one writer wrote into ``directory`` and their sums; ``record()`` leaves them
    in ``.sums/<writer>.json`` for the manifest."""

    directory: Path
    writer: str
    files: dict[str, dict] = field(default_factory=dict)

    def write_bytes(self, path: Path, data: bytes) -> None:
        """``data`` into ``path`` (temp file, fsync, rename), summed."""
        with _Writing(path) as out:
            out.write(data)
        self._add(path, out)

    def save_safetensors(self, path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
        """``tensors`` (name -> a CPU tensor) as a safetensors file at ``path``, streamed and
        summed; ``path`` is absent or complete."""
        self._add(path, write_safetensors(path, tensors, metadata))

    def copy(self, source: Path, target: Path) -> None:
        """``source`` (a node-local file a library wrote) into ``target``, summed as it passes."""
        self._add(target, copy_file(source, target, durable=True))

    def record(self) -> None:
        """Leave this writer's sums for the manifest (a small JSON file, atomic)."""
        if self.files:
            fsio.write_record(self.directory / DIRECTORY / f"{self.writer}.json", {"algorithm": ALGORITHM, "files": self.files})

    def _add(self, path: Path, out: "_Writing") -> None:
        self.files[Path(path).relative_to(self.directory).as_posix()] = {"bytes": out.size, ALGORITHM: out.digest}


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None, *, durable: bool = True) -> "_Writing":
    """``tensors`` as a safetensors file at ``path`` (temp file, then rename), streamed and
    summed; fsynced unless not ``durable`` (a node-local copy a crash discards anyway)."""
    header, order = _header(tensors, metadata)
    with _Writing(path, durable=durable) as out:
        out.write(struct.pack("<Q", len(header)))
        out.write(header)
        for name in order:
            out.write(tensor_bytes(tensors[name]))
    return out


def copy_file(source: Path, target: Path, *, durable: bool = False) -> "_Writing":
    """``source``'s bytes into ``target`` (temp file, then rename), summed as they pass: one
    read of ``source``. Returns the writing, whose ``digest`` and ``size`` say what was copied."""
    with open(source, "rb") as f, _Writing(target, durable=durable) as out:
        while chunk := f.read(CHUNK):
            out.write(chunk)
    return out


def gathered(directory: Path) -> dict[str, dict]:
    """Every writer's sums under ``directory``, by file name relative to it."""
    out: dict[str, dict] = {}
    where = directory / DIRECTORY
    if where.is_dir():
        fsio.refresh_dir(where)
        for record in sorted(where.glob("*.json")):
            body = fsio.read_record(record)
            if body is not None and body.get("algorithm") == ALGORITHM:
                out.update(body["files"])
    return out


class _Writing:
    """A file written through a temp name, hashed as it is written, fsynced, then renamed."""

    def __init__(self, path: Path, *, durable: bool = True):
        self.path = Path(path)
        self.durable = durable
        self.temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.hash = hasher()
        self.size = 0
        self.digest = ""

    def __enter__(self) -> "_Writing":
        self.file = open(self.temp, "wb")
        return self

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.file.write(view)
        self.size += len(view)

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None and self.durable:
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()
        if kind is not None:
            self.temp.unlink(missing_ok=True)
            return
        os.replace(self.temp, self.path)
        self.digest = self.hash.hexdigest()


def _header(tensors: dict, metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """The safetensors header (JSON, padded with spaces to a multiple of 8 bytes) and the
    order the tensors' bytes follow it in: by name, each at the offset the header gives."""
    order = sorted(tensors)
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        dtype = _DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), order


def tensor_bytes(tensor):
    """A tensor's bytes as a uint8 numpy array, without a copy when it is a contiguous CPU
    tensor (as uint8: numpy has no bfloat16)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()
