"""The new checkpoint, written into the staging directory ``output`` after the update: every
worker writes its part of the weights and of the optimizer state in parallel (with fsdp the
tensors it owns are gathered; with ddp every worker holds them all already) and worker 0 the
indexes (checkpoints/sharded.py); a single worker writes one file of each. With LoRA worker 0
writes the adapter (train/lora.py), and the optimizer state as for the whole model. Each
worker sums the files it writes as it writes them (checkpoints/sums.py), the configs and
tokenizer too, so sealing reads none of them back.

The weights the engines read are in ``publish_dtype`` (auto: the dtype they serve, which a
whole model's ``config.json`` names: train/precision.py); when that is not fp32, the fp32
master weights go to ``master/`` beside them, for the trainer alone. The optimizer state is
fp32 (an adapter is kept in fp32 too: megabytes). ``train_stats.json`` comes last, so it
vouches for everything else; the final barrier after it is what a ``done`` answer waits for."""

from __future__ import annotations

import json
import logging
import time

from orchestrator.phase_table import Phase
from orchestrator.protocol import faults, fsio
from orchestrator.checkpoints import deltas, optimizer_state, sharded, sums
from orchestrator.checkpoints.files import MASTER_DIR
from orchestrator.train import lora, precision
from orchestrator.train.errors import TrainerError
from orchestrator.train.policy import Policy
from orchestrator.train.request import TrainRequest

log = logging.getLogger(__name__)

STATS_FILE = "train_stats.json"


def write(policy: Policy, config: TrainRequest, stats: dict, started: float, base: sharded.DeltaBase | None = None) -> None:
    """Every worker writes its part (one worker: the whole checkpoint); then every worker
    passes the final barrier. ``train_stats.json`` comes last, from worker 0."""
    rank, world_size, output, device = policy.rdv.rank, policy.rdv.world_size, config.output, policy.device
    model, optimizer = policy.model, policy.optimizer
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        # A stats file left by an earlier attempt would vouch for weights being rewritten now.
        (output / STATS_FILE).unlink(missing_ok=True)
    written = sums.Sums(output, f"worker-{rank}")  # each file summed as it is written: sealing reads none back
    if policy.setup.lora:  # the adapter and its optimizer state only: megabytes (train/lora.py)
        def barrier() -> None:
            _barrier(device, "checkpoint shard")

        if policy.setup.sharded:
            barrier()  # worker 0 made the directory
        lora.save(model, output, rank=rank, written=written)
        if rank == 0:
            _library_files(output, written, model.peft_config["default"].save_pretrained)
        if policy.setup.sharded and config.write_state:
            optimizer_state.save_sharded(optimizer, model, output, rank=rank, world_size=world_size, barrier=barrier,
                                         written=written, parallel=config.parallel_write)
        elif rank == 0 and config.write_state:
            optimizer_state.save(optimizer, model, output, written)
    elif policy.setup.sharded or world_size > 1:  # fsdp, or ddp at more than one worker: each writes the tensors it owns
        def barrier() -> None:
            _barrier(device, "checkpoint shard")

        barrier()  # worker 0 made the directory
        stats["published"] = _as(sharded.save_model(model, output, rank=rank, world_size=world_size, barrier=barrier, written=written,
                                                     parallel=config.parallel_write, dtype=_published(policy, config), delta=base,
                                                     state=config.write_state), base)
        if config.write_state:
            optimizer_state.save_sharded(optimizer, model, output, rank=rank, world_size=world_size, barrier=barrier,
                                         written=written, parallel=config.parallel_write)
    else:
        stats["published"] = _as(sharded.save_whole(model, output, written, dtype=_published(policy, config), delta=base,
                                                    state=config.write_state), base)
        if config.write_state:
            optimizer_state.save(optimizer, model, output, written)
    if rank == 0 and not policy.setup.lora:  # an adapter uses its base's tokenizer (vLLM warns about one of its own)
        _library_files(output, written, lambda directory: _save_configs(model, policy.tokenizer, directory, policy.served_dtype))
    written.record()
    if "delta" in stats.get("published", ""):
        faults.hold_in_child("hold-in-delta", config.iteration, Phase.TRAIN, log)
    if rank == 0:
        files = [p for p in output.rglob("*") if p.is_file() and sums.DIRECTORY not in p.parts]
        stats["checkpoint_bytes"] = sum(p.stat().st_size for p in files)
        # the training state (the optimizer's, the fp32 master kept apart): what no engine reads
        stats["state_bytes"] = sum(p.stat().st_size for p in files if p.relative_to(output).parts[0] in (optimizer_state.DIRECTORY, MASTER_DIR))
        stats["state"] = config.write_state
        if "delta" in stats.get("published", ""):
            stats["delta_base"] = base.iteration
            stats["delta_bytes"] = sum(p.stat().st_size for p in files if p.parent == output and p.name.startswith(f"{deltas.PREFIX}-"))
        stats["seconds"] = round(time.monotonic() - started, 3)
        fsio.atomic_write_bytes(output / STATS_FILE, json.dumps(stats, indent=1).encode())
        log.info("wrote checkpoint to %s (%.1fs%s)", output, stats["seconds"],
                 f"; its weights as a delta against iteration {base.iteration}: {stats['delta_bytes']} bytes" if "delta_base" in stats else "")
    _barrier(device)


def _published(policy: Policy, config: TrainRequest):
    """The torch dtype of the weights the engines read (None: the master's own, fp32)."""
    import torch

    name = precision.published_dtype(policy.served_dtype, config.publish_dtype, adapter=False)
    return None if name == precision.MASTER else getattr(torch, name)


def _as(delta: bool, base: sharded.DeltaBase | None) -> str:
    """What ``train_stats.json`` says was published: ``full``, ``delta``, or ``full+delta``."""
    return ("full+delta" if base.also_full else "delta") if delta else "full"


def delta_base(policy: Policy, config: TrainRequest) -> sharded.DeltaBase | None:
    """Before the update: the published weights of the version it starts from (the init
    checkpoint's, exactly: the master weights it holds, cast as they were published; the base
    model's own bits when it is saved in the published dtype), which this version's may be
    written as a delta against (``publish.delta``). The first version and every
    ``publish.full_every``-th are written whole as well. None when there is nothing to write a
    delta against: LoRA (an adapter is megabytes), a base in another dtype, or a version
    before published in another. Every worker calls it (fsdp gathers)."""
    if not config.publish_delta or policy.setup.lora:
        return None
    published = precision.published_dtype(policy.served_dtype, config.publish_dtype, adapter=False)
    if config.init_iteration is None:
        before = precision.checkpoint_dtype(config.init_checkpoint)
    else:
        try:
            before = json.loads((config.init_checkpoint / STATS_FILE).read_bytes()).get("published_dtype")
        except (OSError, ValueError, AttributeError):
            before = None
    if before != published:
        return None
    rank, world_size = policy.rdv.rank, policy.rdv.world_size
    iteration = config.init_iteration or 0
    also_full = iteration == 0 or config.iteration % config.publish_full_every == 0
    tensors = sharded.owned(policy.model, rank=rank, world_size=world_size, parallel=config.parallel_write,
                            dtype=_published(policy, config))
    return sharded.DeltaBase(tensors, iteration, _smaller(policy) if world_size > 1 else lambda d, f: d < f, also_full)


def _smaller(policy: Policy):
    """Whether every writer's deltas add up to fewer bytes than their whole weights (a
    collective: every worker calls it once)."""
    def smaller(delta_bytes: int, full_bytes: int) -> bool:
        import torch
        import torch.distributed as dist

        both = torch.tensor([delta_bytes, full_bytes], dtype=torch.float64, device=policy.device)
        dist.all_reduce(both)
        return bool(both[0] < both[1])

    return smaller


def _save_configs(model, tokenizer, output, served_dtype) -> None:
    """The model's config (naming the dtype the engines serve), generation config and tokenizer."""
    model.config.save_pretrained(output)
    precision.write_served_dtype(output, served_dtype)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(output)
    tokenizer.save_pretrained(output)


def _library_files(output, written: sums.Sums, save) -> None:
    """The small files a library writes (``save(directory)``: configs, tokenizer), written into
    a node-local temp directory and copied into ``output``, summed as they pass: sealing reads
    nothing back from the shared filesystem, whatever their size (a tokenizer: megabytes)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="orchestrator-checkpoint-files-") as tmp:
        save(tmp)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                target = output / f.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                written.copy(f, target)


def _barrier(device, what: str = "final barrier") -> None:
    """Every rank has its part of the update done, and rank 0 its checkpoint written; a rank 0
    that dies on the way makes this fail."""
    import torch.distributed as dist

    try:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
    except Exception as e:
        raise TrainerError(f"{what} failed (a peer died or timed out): {type(e).__name__}: {e}") from None
