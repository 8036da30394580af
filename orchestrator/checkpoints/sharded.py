"""Tensors the train workers hold in parts (FSDP), written as a standard sharded safetensors
checkpoint: each worker writes whole tensors into its own file, in parallel, and worker 0
writes the index last.

Each tensor has one owner, chosen by size (largest first to the least loaded worker), so
every worker writes about 1/N of the bytes. For each tensor, in the same order on every
worker, the parts are gathered (an all-gather: every worker takes part) and the owner keeps
the whole tensor; so no worker ever holds more than its own share plus one tensor.

On a shared filesystem (prime-rl's ``save_state_dict_parallel`` learned the same): the
directory exists before anyone writes (worker 0 makes it, then a barrier), each worker
writes a temp file (summed as it is written: sums.py), fsyncs it and renames only its own file, and the index comes after a
barrier that every worker reaches only once its file is in place. A complete index therefore
means complete shards; the checkpoint's manifest (manifest.py) then covers every file.

Index format, as Hugging Face's ``model.safetensors.index.json``:
``{"metadata": {"total_size": BYTES, ...}, "weight_map": {tensor name: file name}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.checkpoints.files import MASTER_DIR
from orchestrator.checkpoints.sums import Sums


def owners(sizes: dict[str, int], world_size: int, *, parallel: bool = True) -> dict[str, int]:
    """Tensor name -> the worker that writes it (all worker 0's when not ``parallel``)."""
    if not parallel:
        return dict.fromkeys(sizes, 0)
    load = [0] * world_size
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        worker = min(range(world_size), key=lambda w: (load[w], w))
        out[name] = worker
        load[worker] += sizes[name]
    return out


def file_names(owner_of: dict[str, int], prefix: str, suffix: str = ".safetensors") -> dict[int, str]:
    """Worker -> its file, for the workers that own a tensor: ``<prefix>-00001-of-00003<suffix>``."""
    writers = sorted(set(owner_of.values()))
    return {w: f"{prefix}-{i + 1:05d}-of-{len(writers):05d}{suffix}" for i, w in enumerate(writers)}


def full_size(tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor's numel is its whole shape's


def gather(named: list[tuple[str, object]], owner_of: dict[str, int], rank: int) -> dict[str, object]:
    """The whole tensors this worker owns, on the CPU. Every worker calls this with the same
    names in the same order (each DTensor's gather is collective)."""
    mine = {}
    for name, tensor in named:
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if owner_of[name] == rank:
            mine[name] = whole.detach().to("cpu", copy=True).contiguous()
        del whole
    return mine


def write_file(tensors: dict, path: Path, metadata: dict[str, str], written: Sums) -> None:
    """Temp file, fsync, rename: ``path`` is absent or complete; summed as it is written."""
    written.save_safetensors(path, tensors, metadata)


def write_index(path: Path, owner_of: dict[str, int], files: dict[int, str], total_size: int, written: Sums, **metadata) -> None:
    body = {"metadata": {"total_size": total_size, **metadata}, "weight_map": {name: files[owner_of[name]] for name in sorted(owner_of)}}
    written.write_bytes(path, json.dumps(body, indent=2).encode())


def read_index(path: Path) -> dict[str, str]:
    """Tensor name -> file name; raises ValueError naming the file when it is not an index."""
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a readable safetensors index: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{path}: weight_map is not a map of tensor names to file names")
    return weight_map


def model_tensors(model) -> list[tuple[str, object]]:
    """The tensors a Hugging Face checkpoint of ``model`` holds, by name: its state dict, each
    tied parameter once (under the first name, as ``save_pretrained`` keeps it)."""
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class DeltaBase:
    """What a version's weights can be written as a delta against (deltas.py): the tensors
    of the version before that this worker writes, in the published dtype, and its iteration.
    ``smaller(delta_bytes, full_bytes)`` says whether the delta is worth writing: every
    writer's bytes added up (with fsdp a collective, so every worker calls it alike)."""

    tensors: dict
    iteration: int
    smaller: Callable[[int, int], bool]
    also_full: bool = False
    """Write the weights whole as well (the first version, every publish.full_every): a node
    that holds the version before reads the delta, one that holds none the full copy."""


def owned(model, *, rank: int, world_size: int, parallel: bool, dtype=None) -> dict:
    """The whole tensors this worker writes (as :func:`save_model` shares them out), copied to
    the CPU in ``dtype`` (None: their own). Every worker calls it (a sharded tensor's gather
    is collective)."""
    named, owner_of = _shared_out(model, world_size, parallel)
    return _cast(gather(named, owner_of, rank), dtype)


def _shared_out(model, world_size: int, parallel: bool) -> tuple[list, dict[str, int]]:
    """``model``'s tensors and the worker that writes each."""
    named = model_tensors(model)
    return named, owners({name: full_size(t) for name, t in named}, world_size, parallel=parallel)


def save_model(model, output: Path, *, rank: int, world_size: int, barrier, written: Sums, parallel: bool = True,
               dtype=None, delta: DeltaBase | None = None, state: bool = True) -> bool:
    """The weights of a sharded ``model`` into ``output``: whole as ``model-0000i-of-0000n.safetensors``
    and, from worker 0 after every worker's file is in place, the index; or, given ``delta``
    and when it is smaller, as deltas against it (``delta-0000i-of-0000n.safetensors`` and
    ``delta.json``). In ``dtype`` (None: their own); the weights in their own dtype go to
    ``master/`` too whenever the published ones are not they (each tensor gathered once),
    unless not ``state`` (checkpoint.state_every). ``barrier()`` waits for every worker. The config, generation config and tokenizer are the
    caller's. Returns whether a delta was written."""
    named, owner_of = _shared_out(model, world_size, parallel)
    mine = gather(named, owner_of, rank)
    as_delta, full, master = _write(mine, output, owner_of, rank, written, dtype, delta, state=state)
    del mine
    barrier()
    if rank == 0:
        total = sum(t.numel() * (dtype.itemsize if dtype is not None else t.element_size()) for _, t in named)
        _indexes(output, owner_of, total, written, dtype, delta if as_delta else None, full=full,
                 master_total=sum(t.numel() * t.element_size() for _, t in named) if master else 0)
    return as_delta


def save_whole(model, output: Path, written: Sums, *, dtype=None, delta: DeltaBase | None = None, state: bool = True) -> bool:
    """The weights of an unsharded ``model`` as one ``model.safetensors`` (what
    ``save_pretrained`` writes, tied parameters once) in ``dtype`` (None: their own), or given
    ``delta`` and when smaller as a delta against it; the weights in their own dtype in
    ``master/`` whenever the published ones are not they (unless not ``state``). One writer. Returns whether a delta
    was written."""
    tensors = {name: t.detach() for name, t in model_tensors(model)}
    owner_of = dict.fromkeys(tensors, 0)
    as_delta, _, _ = _write(tensors, output, owner_of, 0, written, dtype, delta, whole=True, state=state)
    if as_delta:
        total = sum(t.numel() * (dtype.itemsize if dtype is not None else t.element_size()) for t in tensors.values())
        _indexes(output, owner_of, total, written, dtype, delta, full=False, master_total=None)
    return as_delta


def _write(mine: dict, output: Path, owner_of: dict[str, int], rank: int, written: Sums, dtype, delta: DeltaBase | None,
           whole: bool = False, state: bool = True) -> tuple[bool, bool, bool]:
    """This worker's tensors written: published (whole, or as a delta when that is smaller,
    or both when ``delta.also_full``) and, where the published ones are not the master, the
    master. Returns (delta written, whole written, master written)."""
    from orchestrator.checkpoints import deltas

    published = _cast(mine, dtype)
    as_delta = False
    if delta is not None:
        encoded = deltas.encode(published, delta.tensors) if published else deltas.Encoded()
        as_delta = delta.smaller(encoded.size, sum(full_size(t) for t in published.values()))
    full = not as_delta or delta.also_full
    if as_delta and encoded.frames:
        deltas.write_file(output / file_names(owner_of, deltas.PREFIX)[rank], encoded, delta.iteration, written)
    if full and published:
        write_file(published, output / ("model.safetensors" if whole else file_names(owner_of, "model")[rank]), {"format": "pt"}, written)
    master = (dtype is not None or not full) and state
    if master and mine:
        (output / MASTER_DIR).mkdir(exist_ok=True)
        write_file(mine, output / MASTER_DIR / ("model.safetensors" if whole else file_names(owner_of, "model")[rank]),
                   {"format": "pt"}, written)
    return as_delta, full, master


def _indexes(output: Path, owner_of: dict[str, int], total: int, written: Sums, dtype, delta: DeltaBase | None, *, full: bool,
             master_total: int | None) -> None:
    """Worker 0, once every worker's file is in place: the published weights' index (the
    delta's, or the shards' when ``master_total`` is given: a sharded model), and the
    master's shards' index when it was written (``master_total`` bytes)."""
    from orchestrator.checkpoints import deltas

    if delta is not None:
        names = file_names(owner_of, deltas.PREFIX)
        deltas.write_index(output, {n: names[w] for n, w in owner_of.items()}, base=delta.iteration,
                           dtype=str(dtype or "float32").removeprefix("torch."), total_size=total, written=written)
    if full and master_total is not None:
        write_index(output / WEIGHTS_INDEX, owner_of, file_names(owner_of, "model"), total, written)
    if master_total:
        (output / MASTER_DIR).mkdir(exist_ok=True)
        write_index(output / MASTER_DIR / WEIGHTS_INDEX, owner_of, file_names(owner_of, "model"), master_total, written)


def read_all(directory: Path, prefix: str = "model") -> dict:
    """Every tensor of ``<prefix>.safetensors`` in ``directory``, or of the shards its index names."""
    from safetensors.torch import load_file

    index = directory / f"{prefix}.safetensors.index.json"
    files = sorted(set(read_index(index).values())) if index.is_file() else [f"{prefix}.safetensors"]
    out = {}
    for name in files:
        out.update(load_file(directory / name))
    return out


def _cast(tensors: dict, dtype) -> dict:
    """Floating-point tensors in ``dtype`` (None: as they are); others as they are."""
    if dtype is None:
        return tensors
    return {n: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for n, t in tensors.items()}
