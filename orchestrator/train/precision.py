"""The dtypes a train worker keeps, whatever dtype its checkpoint was saved in.

- **Master weights and AdamW's state are fp32.** A released model is saved in bf16; trained
  in bf16, an update smaller than half a unit in the last place (about 0.4% of a weight's
  value) is rounded away, and at RL's learning rates (1e-7 to 1e-5) that is most of every
  update. So every trained parameter is loaded in fp32, and its moments follow it.
  ``train.mixed_precision=bf16`` only changes the compute (parallel.py), never these.
- **The frozen base under LoRA** has no update to lose: with bf16 compute it stays in its
  checkpoint's 16-bit dtype (half the memory); with fp32 compute it is loaded in fp32, so that
  the forward is the fp32 model's exactly.
- **What the engines serve is the base's dtype.** A checkpoint's ``config.json`` keeps the
  dtype its init checkpoint named (``"dtype": "bfloat16"``), which vLLM (``--dtype auto``)
  and the embedded engine load the weights in, as they did the base; its weights are written
  in that dtype (``publish.dtype=auto``: half the bytes an engine reads from a bf16 base),
  and the fp32 master beside them in ``master/``, which only a trainer reads.
"""

from __future__ import annotations

import json
from pathlib import Path

MASTER = "float32"
"""The dtype of every trained parameter and its optimizer state."""

_SIXTEEN_BIT = ("bfloat16", "float16")


def checkpoint_dtype(directory: Path) -> str:
    """The dtype a Hugging Face model directory is served in, as ``dtype="auto"`` loads it: its
    ``config.json``'s ``dtype`` (``torch_dtype`` before transformers 5), else the dtype of its
    first floating-point weight."""
    config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    named = config.get("dtype") or config.get("torch_dtype")
    if isinstance(named, str) and named != "auto":
        return named.removeprefix("torch.")
    return _weights_dtype(Path(directory))


def _weights_dtype(directory: Path) -> str:
    from safetensors import safe_open

    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                found = names.get(f.get_slice(key).get_dtype())
                if found:
                    return found
    return MASTER


def load_dtype(directory: Path, *, frozen: bool, mixed_precision: str):
    """The torch dtype to load ``directory``'s weights in: fp32 for weights that train (and a
    KL reference, which must compute as the policy does); a frozen base keeps its own 16-bit
    dtype under bf16 compute."""
    import torch

    if frozen and mixed_precision == "bf16":
        own = checkpoint_dtype(directory)
        if own in _SIXTEEN_BIT:
            return getattr(torch, own)
    return torch.float32


def to_master(model) -> None:
    """Every trainable parameter of ``model`` in fp32 (peft makes adapters in the base's dtype
    unless told otherwise: ``autocast_adapter_dtype`` does it for bf16 and fp16 bases)."""
    import torch

    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def frozen_dtype(model) -> str | None:
    """The dtype of ``model``'s frozen parameters (None: every parameter trains)."""
    frozen = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if not p.requires_grad}
    return ",".join(sorted(frozen)) or None


def published_dtype(served: str, requested: str, *, adapter: bool) -> str:
    """The dtype of the weights a checkpoint gives the engines: ``requested`` (publish.dtype
    resolved; auto: ``served``, the dtype they serve); an adapter stays fp32 (megabytes,
    merged into the base by the engines)."""
    if adapter:
        return MASTER
    return served if requested == "auto" else requested


def write_served_dtype(output: Path, dtype: str) -> None:
    """Make ``output/config.json`` name ``dtype`` (save_pretrained wrote the fp32 weights' own)."""
    from orchestrator.protocol import fsio

    path = Path(output) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("dtype") == dtype and "torch_dtype" not in config:
        return
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    fsio.atomic_write_bytes(path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
