"""Published weights as deltas (``publish.delta``): a version's weights, in the dtype the
engines serve, as the XOR of their bits against the version before, compressed with zstd.

After an RL step at a small learning rate most 16-bit values do not change, and most of those
that do move by one unit in the last place: the XOR is mostly zero bytes and compresses to a
few percent of the weights (docs/performance.md). A delta is exact: applying it to its base's
bits gives the new version's bits, each tensor checked against the sum of its values
(xxh3-128 of the reconstructed bytes) before anything serves it.

In a checkpoint directory a delta replaces the weights at the top level (``model*.safetensors``):

- ``delta-0000i-of-0000n.safetensors``: one file per train worker that owns tensors (as
  sharded.py shares them out); each tensor is a uint8 tensor holding one zstd frame, the XOR
  of that tensor's bits; the file's metadata names, per tensor, the dtype, shape and sum of
  the values it reconstructs (``tensors``, JSON) and the base version (``base``).
- ``delta.json`` (this module's ``INDEX``), written last by worker 0: the format, the base
  version's iteration, the dtype, the full weights' bytes, and which file holds each tensor.

A version without ``delta.json`` holds its weights whole; so does a version written whole on
purpose (the first, every ``publish.full_every`` iterations), which holds the delta besides
when one can be made, so that a node holding the version before still reads only the delta;
and one whose delta would not be smaller holds only the full copy. The versions from the last
full copy up to a version are its chain.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.checkpoints.sums import Sums, hasher, tensor_bytes

FORMAT = "xor-zstd"
INDEX = "delta.json"
PREFIX = "delta"
LEVEL = 1
"""zstd's level: the fastest; the XOR of a small step is mostly zeros, which every level finds."""


def tensor_sum(tensor) -> str:
    """The sum of a CPU tensor's bytes (its values as they are stored)."""
    h = hasher()
    h.update(tensor_bytes(tensor))
    return h.hexdigest()


@dataclass(slots=True)
class Encoded:
    """One writer's tensors as deltas: each tensor's zstd frame (a uint8 tensor) and what it
    reconstructs (dtype, shape, sum)."""

    frames: dict = field(default_factory=dict)
    tensors: dict[str, dict] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(f.numel() for f in self.frames.values())


def encode(new: dict, base: dict) -> Encoded:
    """``new`` (name -> CPU tensor, the version's values) against ``base`` (the same names,
    dtypes and shapes: the version before). Raises ValueError when they do not line up."""
    import numpy as np
    import torch
    import zstandard

    compressor = zstandard.ZstdCompressor(level=LEVEL)
    out = Encoded()
    for name in sorted(new):
        t, b = new[name], base.get(name)
        if b is None or b.dtype != t.dtype or tuple(b.shape) != tuple(t.shape):
            raise ValueError(f"tensor {name} has no like base ({None if b is None else (b.dtype, tuple(b.shape))} "
                             f"against {(t.dtype, tuple(t.shape))})")
        bits = tensor_bytes(t)
        xor = np.bitwise_xor(bits, tensor_bytes(b))
        out.frames[name] = torch.frombuffer(bytearray(compressor.compress(xor.tobytes())), dtype=torch.uint8)
        out.tensors[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sum": tensor_sum(t)}
    return out


def write_file(path: Path, encoded: Encoded, base: int, written: Sums) -> None:
    """One writer's deltas as a safetensors file (summed as it is written)."""
    written.save_safetensors(path, encoded.frames, {"format": FORMAT, "base": str(base),
                                                    "tensors": json.dumps(encoded.tensors, separators=(",", ":"))})


def write_index(directory: Path, weight_map: dict[str, str], *, base: int, dtype: str, total_size: int, written: Sums) -> None:
    body = {"format": FORMAT, "base": base, "dtype": dtype, "total_size": total_size, "weight_map": dict(sorted(weight_map.items()))}
    written.write_bytes(directory / INDEX, json.dumps(body, indent=1).encode())


def is_delta(directory: Path) -> bool:
    """Whether a checkpoint's weights are published as a delta (maybe besides a full copy)."""
    return (Path(directory) / INDEX).is_file()


def is_whole(directory: Path) -> bool:
    """Whether a checkpoint holds its published weights whole (``model*.safetensors``)."""
    return any(Path(directory).glob("model*.safetensors"))


def needs_base(directory: Path) -> bool:
    """Whether a checkpoint's weights exist only as a delta: rebuilding them needs its chain."""
    return is_delta(directory) and not is_whole(directory)


class DeltaError(ValueError):
    """A delta that cannot be applied: damaged, missing, or not of this format. Names the file."""


def read_index(directory: Path, data: bytes | None = None) -> dict:
    """``delta.json`` of ``directory`` (its bytes when already read). Raises DeltaError."""
    path = Path(directory) / INDEX
    try:
        body = json.loads(data if data is not None else path.read_bytes())
        if body.get("format") != FORMAT or not isinstance(body.get("weight_map"), dict) or not isinstance(body.get("base"), int):
            raise ValueError(f"not a {FORMAT} index")
    except (OSError, ValueError) as e:
        raise DeltaError(f"{path} is not a readable delta index ({e})") from None
    return body


def base_of(directory: Path) -> int | None:
    """The version a checkpoint's weights are a delta against (None: they are whole)."""
    return read_index(directory)["base"] if is_delta(directory) else None


def decode_file(path: Path, data: bytes, base: dict) -> dict:
    """The tensors a delta file reconstructs from ``base`` (name -> the base version's CPU
    tensor), each checked against its sum. Raises DeltaError naming ``path``."""
    import numpy as np
    import torch
    import zstandard
    from safetensors.torch import load

    try:
        header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
        tensors = json.loads(header["__metadata__"]["tensors"])
        frames = load(data)
    except Exception as e:  # noqa: BLE001 - a damaged header or frame table, whatever the parser says
        raise DeltaError(f"delta {path} is damaged: its header does not parse ({type(e).__name__}: {e})") from None
    decompressor = zstandard.ZstdDecompressor()
    out = {}
    for name, meta in tensors.items():
        b = base.get(name)
        dtype = getattr(torch, meta["dtype"], None)
        if b is None or b.dtype != dtype or list(b.shape) != meta["shape"] or name not in frames:
            raise DeltaError(f"delta {path}: tensor {name} does not fit the version it applies to")
        try:
            xor = np.frombuffer(decompressor.decompress(frames[name].numpy().tobytes()), dtype=np.uint8)
        except zstandard.ZstdError as e:
            raise DeltaError(f"delta {path} is damaged: tensor {name} does not decompress ({e})") from None
        base_bits = tensor_bytes(b)
        if xor.size != base_bits.size:
            raise DeltaError(f"delta {path} is damaged: tensor {name} has {xor.size} bytes, its base {base_bits.size}")
        t = torch.from_numpy(np.bitwise_xor(base_bits, xor)).view(dtype).reshape(meta["shape"])
        if tensor_sum(t) != meta["sum"]:
            raise DeltaError(f"delta {path} is damaged: tensor {name} does not reconstruct to its sum")
        out[name] = t
    return out
