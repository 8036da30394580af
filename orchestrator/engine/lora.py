"""LoRA adapters in the embedded engine: each adapter is merged into the base's weights in
place, W = W_base + (lora_alpha / r) B A, so a forward costs what the base's does. The base
weights an adapter touches are kept aside the first time, and every later adapter is merged
into them, not into the previous merge: no error piles up over iterations, and nothing of
the base is read again from disk.

Reads peft's format (``adapter_config.json``, ``adapter_model.safetensors``) as the trainer
writes it (train/lora.py): plain LoRA on linear layers. DoRA, rsLoRA, biases and layers
stored transposed are refused with a message, never merged wrong.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoints.files import ADAPTER_CONFIG as CONFIG
from orchestrator.checkpoints.files import ADAPTER_WEIGHTS as WEIGHTS
from orchestrator.checkpoints.files import adapter_config

_PREFIX = "base_model.model."


def deltas(directory: Path) -> dict[str, object]:
    """Each adapted weight's name in the base model and what the adapter adds to it (fp32).
    Raises ValueError for an adapter this merge does not cover."""
    from safetensors.torch import load_file

    cfg = adapter_config(directory)
    unsupported = [k for k in ("use_dora", "use_rslora", "fan_in_fan_out") if cfg.get(k)]
    if cfg.get("peft_type", "LORA") != "LORA" or unsupported or cfg.get("bias", "none") != "none":
        raise ValueError(f"{directory / CONFIG}: only plain LoRA adapters are merged here (peft_type LORA, bias none; not "
                         f"{', '.join(unsupported) or cfg.get('peft_type')})")
    scale = float(cfg["lora_alpha"]) / int(cfg["r"])
    tensors = load_file(directory / WEIGHTS)
    pairs: dict[str, dict[str, object]] = {}
    for key, tensor in tensors.items():
        module, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"{directory / WEIGHTS}: {key} is not a LoRA A or B weight")
        pairs.setdefault(module, {})[part[0]] = tensor.float()
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{directory / WEIGHTS}: {module} has lora_{''.join(ab)} without its pair")
        out[f"{module}.weight"] = (ab["B"] @ ab["A"]) * scale
    return out


class Merger:
    """The served model's base weights, with one adapter merged at a time."""

    def __init__(self, model):
        self.model = model
        self._base: dict[str, object] = {}  # the base's own weights, of the modules an adapter touched

    def apply(self, directory: Path) -> int:
        """Merge the adapter at ``directory`` (and only it) into the base; returns the weights
        changed. Raises ValueError, the model untouched, when it does not fit the base."""
        import torch

        add = deltas(Path(directory))
        params = dict(self.model.named_parameters())
        for name, delta in add.items():
            if name not in params:
                raise ValueError(f"the adapter at {directory} adapts {name}, which the served model lacks")
            if tuple(delta.shape) != tuple(params[name].shape):
                raise ValueError(f"the adapter at {directory} changes {name} by {tuple(delta.shape)}, the model's is {tuple(params[name].shape)}")
        with torch.no_grad():
            for name in set(self._base) - set(add):  # adapted before, not now: the base again
                params[name].copy_(self._base[name])
            for name, delta in add.items():
                param = params[name]
                base = self._base.setdefault(name, param.detach().clone())
                param.copy_((base.float() + delta.to(base.device)).to(param.dtype))
        return len(add)

    def forget(self) -> None:
        """The whole weights were replaced: nothing of the old base is kept."""
        self._base.clear()
