"""How the train workers share the model (``train.strategy``), its compute precision
(``train.mixed_precision``) and activation checkpointing (``train.activation_checkpointing``).

- ``ddp``: every worker holds the whole model, its gradients and AdamW's two moments (16
  bytes per parameter in fp32); the gradients are averaged at each step's last backward.
- ``fsdp``: FSDP2 (``fully_shard``) per transformer block and at the root. Each worker holds
  1/N of the parameters, gradients and optimizer state; a block's parameters are gathered
  for its forward and backward and freed after, and gradients are reduce-scattered.

``bf16`` computes in bfloat16 and keeps fp32 master weights, gradient reduction and optimizer
state: FSDP through its ``MixedPrecisionPolicy``, DDP under ``torch.autocast``. The weights are
fp32 whatever dtype the model was saved in (precision.py).

Activation checkpointing recomputes each block's activations in the backward instead of
keeping them (``torch.distributed._composable.checkpoint``, which keeps parameter names as
they are, so checkpoints and optimizer state read the same with it on or off).

Transformer blocks are the modules whose class the model names in ``_no_split_modules``
(every Hugging Face causal LM does: ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...).
"""

from __future__ import annotations

import contextlib

from orchestrator.train.settings import PRECISIONS, STRATEGIES  # noqa: F401 (the valid values, checked there)


def blocks(model) -> list:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"{type(model).__name__} names no transformer block class (_no_split_modules): "
                         f"FSDP and activation checkpointing wrap each block, and found none")
    return found


def mesh(device, world_size: int):
    """The workers' one-dimensional device mesh, of ``device``'s type. Given explicitly: on a
    machine with a GPU, a gloo group's default mesh would be CUDA and FSDP fails on CPU
    tensors (pytorch #132471)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


def prepare(model, *, strategy: str, device, world_size: int, mixed_precision: str, activation_checkpointing: bool):
    """Activation checkpointing per block, then FSDP2 per block and at the root (``fsdp``).
    The model is changed in place and returned; with ``ddp`` it stays whole (DDP wraps it for
    each update: ``Sync``)."""
    import torch

    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks(model):
            checkpoint(block)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision == "bf16" else MixedPrecisionPolicy()
        workers = mesh(device, world_size)
        for block in blocks(model):
            fully_shard(block, mesh=workers, mp_policy=policy)
        fully_shard(model, mesh=workers, mp_policy=policy)
    return model


def autocast(device, *, strategy: str, mixed_precision: str):
    """The forward's precision context: bf16 autocast for DDP (FSDP casts by its policy)."""
    import torch

    if mixed_precision == "bf16" and strategy == "ddp":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Sync:
    """The model as one update trains it: DDP built for the update (it broadcasts worker 0's
    parameters, so every worker starts equal), or the FSDP model itself. ``micro_batch(last)``
    is the context of one micro-batch's forward and backward: gradients are reduced over the
    workers only at the step's last one, and accumulate locally before it."""

    def __init__(self, model, *, strategy: str, device):
        self.strategy = strategy
        self.model = model
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            self.module = model

    def micro_batch(self, last: bool):
        if self.strategy == "ddp":
            return contextlib.nullcontext() if last else self.module.no_sync()
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> float:
        import torch

        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def local(tensor):
    """This worker's own storage of a parameter or state tensor (a DTensor's shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_bytes(model, optimizer) -> dict[str, int]:
    """This worker's own bytes of parameters, gradients and optimizer state."""

    def size(t) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    out = {
        "parameters_bytes": sum(size(p) for p in params),
        "gradients_bytes": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer_bytes": sum(size(v) for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel")),
    }
    out["total_bytes"] = sum(out.values())
    return out
