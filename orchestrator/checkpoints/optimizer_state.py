"""AdamW's state saved with each checkpoint, so the next iteration's trainer continues the
same optimizer instead of starting a fresh one.

Why it matters: a fresh AdamW moves every parameter by about the learning rate in the sign
of its first, noisy gradients, and a trainer that starts a fresh one every iteration pays
that at every iteration. On the demo, continuing the moments is what lifts every seed by
20 points in 10 iterations (docs/rl.md).

Format (nothing pickled): ``<checkpoint>/optimizer/adamw.safetensors`` holds, for every
parameter name of the model, ``<name>/exp_avg``, ``<name>/exp_avg_sq`` and ``<name>/step``.
Hyperparameters are not saved: they come from each iteration's train config. The
subdirectory keeps the file out of the weights that vLLM and transformers load from the
checkpoint's top level.

With FSDP each worker holds 1/N of the state; each writes the whole tensors of the
parameters it owns (checkpoints/sharded.py) into ``optimizer/adamw-0000i-of-0000n.safetensors``,
and worker 0 writes ``optimizer/adamw.safetensors.index.json`` last, mapping each
``<name>/<key>`` to its file. Either layout loads into either strategy at any number of
workers: a sharded parameter reads only its own rows of each tensor.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoints.sums import Sums

DIRECTORY = "optimizer"
FILE = "adamw.safetensors"
INDEX = "adamw.safetensors.index.json"
FORMAT = "orchestrator-adamw-1"
_KEYS = ("exp_avg", "exp_avg_sq", "step")


def path(checkpoint: Path) -> Path:
    return checkpoint / DIRECTORY / FILE


def save(optimizer, model, checkpoint: Path, written: Sums | None = None) -> None:
    """Write the state of ``optimizer`` (an AdamW over ``model``'s parameters) into
    ``checkpoint``, summed as it is written into ``written`` (the writer's sums, sums.py)."""
    tensors = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if not state:
            continue  # a parameter that never had a gradient has no state yet
        for key in _KEYS:
            tensors[f"{name}/{key}"] = state[key].detach().to("cpu", copy=True).contiguous()
    target = path(checkpoint)
    target.parent.mkdir(parents=True, exist_ok=True)
    (written or Sums(checkpoint, "unrecorded")).save_safetensors(target, tensors, {"format": FORMAT})


def save_sharded(optimizer, model, checkpoint: Path, *, rank: int, world_size: int, barrier, written: Sums,
                 parallel: bool = True) -> None:
    """Every worker's part of the state of a sharded ``model``'s AdamW, as whole tensors in
    one file per owner, and the index from worker 0 once every file is in place."""
    from orchestrator.checkpoints import sharded

    named = []
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if state:
            named.extend((f"{name}/{key}", state[key]) for key in _KEYS)
    per_param: dict[str, int] = {}
    for n, t in named:
        per_param[n.rsplit("/", 1)[0]] = per_param.get(n.rsplit("/", 1)[0], 0) + sharded.full_size(t)
    param_owner = sharded.owners(per_param, world_size, parallel=parallel)
    owner_of = {n: param_owner[n.rsplit("/", 1)[0]] for n, _ in named}  # a parameter's three in one file
    files = sharded.file_names(owner_of, "adamw")
    directory = checkpoint / DIRECTORY
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    barrier()
    mine = sharded.gather(named, owner_of, rank)
    if mine:
        sharded.write_file(mine, directory / files[rank], {"format": FORMAT}, written)
    del mine
    barrier()
    if rank == 0:
        sharded.write_index(directory / INDEX, owner_of, files, sum(sharded.full_size(t) for _, t in named), written, format=FORMAT)


class _Reader:
    """The saved tensors by name, single file or sharded; each opened lazily, read by rows."""

    def __init__(self, checkpoint: Path):
        from orchestrator.checkpoints import sharded

        directory = checkpoint / DIRECTORY
        self.where = directory
        if (directory / INDEX).is_file():
            self.files = {name: directory / file for name, file in sharded.read_index(directory / INDEX).items()}
        elif (directory / FILE).is_file():
            from safetensors import safe_open

            with safe_open(directory / FILE, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), directory / FILE)
        else:
            self.files = {}
        self._open: dict[Path, object] = {}

    def read(self, name: str, rows: slice | None = None, shape=None):
        """The tensor, or its ``rows``; raises ValueError when its whole shape is not ``shape``."""
        from safetensors import safe_open

        path = self.files.pop(name)
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        whole = self._open[path].get_slice(name)
        if shape is not None and tuple(whole.get_shape()) != tuple(shape):
            raise ValueError(f"optimizer state {path} has shape {tuple(whole.get_shape())} for {name.rsplit('/', 1)[0]}, the model {tuple(shape)}")
        return self._open[path].get_tensor(name) if rows is None else whole[rows]


def _rows(param) -> slice | None:
    """The rows of the whole tensor that this worker's shard of ``param`` holds (None: all).
    FSDP2 shards dim 0 in ``torch.chunk``'s way: chunks of ceil(n / N) rows, in mesh order."""
    if not hasattr(param, "to_local"):
        return None
    from torch.distributed.tensor import Shard

    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"optimizer state: parameters sharded as {param.placements} are not supported (FSDP's Shard(0) is)")
    n, workers = param.shape[0], param.device_mesh.size()
    chunk = -(-n // workers)
    start = min(param.device_mesh.get_local_rank() * chunk, n)
    return slice(start, start + param.to_local().shape[0])


def _like(param, local):
    """``local`` (this worker's rows) as a tensor placed like ``param``."""
    local = local.to(device=param.device if not hasattr(param, "to_local") else param.to_local().device, dtype=param.dtype)
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def load(optimizer, model, checkpoint: Path) -> int | None:
    """Continue ``optimizer`` from the state saved in ``checkpoint`` (either layout; a sharded
    parameter takes its own rows).

    Returns the step count it continues from, or None when the checkpoint has no optimizer
    state (the base model). Raises ValueError naming the file when the state does not fit
    the model (another architecture, a damaged file).
    """
    import torch
    from safetensors import SafetensorError

    source = checkpoint / DIRECTORY
    steps = set()
    try:
        reader = _Reader(checkpoint)
        if not reader.files:
            return None
        for name, param in model.named_parameters():
            missing = [key for key in _KEYS if f"{name}/{key}" not in reader.files]
            if len(missing) == len(_KEYS):
                continue  # no state saved for it: it starts fresh, as it would have in that run
            if missing:
                raise ValueError(f"optimizer state {source} lacks {', '.join(f'{name}/{k}' for k in missing)}")
            rows = _rows(param)
            exp_avg, exp_avg_sq = (reader.read(f"{name}/{key}", rows, param.shape) for key in ("exp_avg", "exp_avg_sq"))
            step = reader.read(f"{name}/step").to(torch.float32)
            optimizer.state[param] = {"step": step, "exp_avg": _like(param, exp_avg), "exp_avg_sq": _like(param, exp_avg_sq)}
            steps.add(int(step.item()))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"optimizer state {source} is unreadable: {e}") from None
    if reader.files:
        unknown = sorted({key.rsplit("/", 1)[0] for key in reader.files})
        raise ValueError(f"optimizer state {source} has state for parameters the model lacks: {', '.join(unknown[:5])}")
    return max(steps, default=0)
