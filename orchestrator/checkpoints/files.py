"""Which files a checkpoint directory holds: a whole Hugging Face model (``config.json``,
safetensors, tokenizer), or a LoRA adapter of the base model in peft's format
(``adapter_config.json``, ``adapter_model.safetensors``); the optimizer state in
``optimizer/`` either way (optimizer_state.py); and, when the weights at the top are
published in a 16-bit dtype (``publish.dtype``), the fp32 master weights in ``master/``, the
same tensors in the same layout, which only a trainer reads."""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A LoRA checkpoint (train.lora_rank) holds these, peft's, instead of the model's weights."""


MASTER_DIR = "master"


def master_dir(directory: Path) -> Path | None:
    """Where ``directory`` keeps its fp32 master weights apart from the published ones (None:
    the weights at its top level are the master)."""
    master = Path(directory) / MASTER_DIR
    return master if master.is_dir() else None


def has_state(directory: Path) -> bool:
    """Whether a checkpoint holds the training state a trainer continues from: the optimizer's
    (``optimizer/``), written with the fp32 master weights wherever the published ones are
    not they (``checkpoint.state_every`` leaves it out of the others)."""
    return (Path(directory) / "optimizer").is_dir()


def is_adapter(directory: Path) -> bool:
    """Whether the checkpoint at ``directory`` is a LoRA adapter of the base model rather than a whole model."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def weight_bytes(directory: Path) -> int:
    """The bytes of the weights an engine reads to serve ``directory``: its safetensors at the
    top level (a LoRA checkpoint's adapter; not the optimizer state)."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def adapter_config(directory: Path) -> dict:
    """A LoRA checkpoint's ``adapter_config.json`` (peft's: r, lora_alpha, target_modules, ...)."""
    return json.loads((Path(directory) / ADAPTER_CONFIG).read_text(encoding="utf-8"))


def adapter_base(directory: Path) -> str:
    """The base model a LoRA checkpoint was trained on, as its adapter_config.json names it
    (the path on the node that trained it)."""
    return adapter_config(directory).get("base_model_name_or_path") or ""
