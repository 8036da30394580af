"""LoRA with peft: the policy as its frozen base with rank-r adapters on the projections
(``train.lora_rank``), and each checkpoint as the adapter alone, in peft's own format:

    checkpoints/iter-<I>/
      adapter_config.json          peft's: r, lora_alpha, target_modules, base_model_name_or_path
      adapter_model.safetensors    the adapters' weights under peft's names
      optimizer/adamw.safetensors  AdamW's state, of the adapters only
      train_stats.json, orchestrator.manifest.json       (no tokenizer: the base's applies)

The base is referenced, never copied: every node has it at its ``model.path`` (ranks whose
base files differ are refused when they join), and the trainer and the engines apply the
adapter to it. ``peft.PeftModel.from_pretrained`` and vLLM's ``--enable-lora`` read the
directory as it is.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.checkpoints.files import ADAPTER_WEIGHTS, adapter_config, is_adapter
from orchestrator.checkpoints.sums import Sums
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.request import TrainRequest


def _lora_config(config: TrainRequest):
    from peft import LoraConfig

    targets = config.train.lora_target_modules
    return LoraConfig(r=config.train.lora_rank, lora_alpha=config.train.lora_alpha, lora_dropout=config.train.lora_dropout, bias="none",
                      task_type="CAUSAL_LM", target_modules="all-linear" if tuple(targets) == ("all-linear",) else list(targets))


def attach(model, config: TrainRequest):
    """``model`` (the base, loaded) with adapters: fresh ones (seeded by ``config.seed``: B is
    zero, so the policy starts as the base) when ``config.init_checkpoint`` is the base, else
    the adapter saved there, trainable. Raises BadTrainInput when that adapter was made with
    another rank, scale or modules than the config asks for, or names modules the base lacks."""
    import torch
    from peft import PeftModel, get_peft_model

    init = config.init_checkpoint
    if not is_adapter(init):
        torch.manual_seed(config.seed)
        try:
            return get_peft_model(model, _lora_config(config))
        except ValueError as e:  # target modules not found in the base model
            raise BadTrainInput(f"train.lora_target_modules={','.join(config.train.lora_target_modules)}: {e}") from None
    saved = adapter_config(init)
    want = {"r": config.train.lora_rank, "lora_alpha": config.train.lora_alpha}
    differs = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
    if sorted(saved.get("target_modules") or []) != sorted(config.train.lora_target_modules) and tuple(config.train.lora_target_modules) != ("all-linear",):
        differs["target_modules"] = (saved.get("target_modules"), list(config.train.lora_target_modules))
    if differs:
        said = ", ".join(f"{k} {have} (the config: {w})" for k, (have, w) in differs.items())
        raise BadTrainInput(f"{init} holds an adapter with {said}: continue with the settings it was trained with "
                            f"(train.lora_rank, train.lora_alpha, train.lora_target_modules), or start a new --log-path")
    return PeftModel.from_pretrained(model, str(init), is_trainable=True)


def is_base_of(policy, reference: Path) -> bool:
    """Whether ``reference`` (the KL reference) is the base under ``policy``'s adapters."""
    base = policy.base if policy.setup.lora else None
    return base is not None and Path(reference).resolve() == Path(base).resolve()


def adapters_off(model):
    """A context in which ``model`` (with adapters) computes as its base alone (peft's
    ``disable_adapter``): the KL reference without a second copy of the base in memory."""
    return model.disable_adapter()


def dropout(model, on: bool) -> None:
    """The adapters' dropout on (the update's forward passes) or off (log-probs of the old policy)."""
    for module in model.modules():
        drop = getattr(module, "lora_dropout", None)
        if drop is not None and hasattr(drop, "train"):
            drop.train(on)


def save(model, output: Path, *, rank: int, written: Sums | None = None) -> int:
    """Write the adapter into ``output`` from worker 0 (each sharded tensor gathered whole by
    every worker, in the same order: a collective), summed as it is written into ``written``.
    Returns the bytes of its weights on worker 0."""
    from peft import get_peft_model_state_dict

    whole = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            tensor = param.detach()
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            whole[name] = tensor.to("cpu", copy=True).contiguous()
    if rank != 0:
        return 0
    tensors = get_peft_model_state_dict(model, state_dict=whole)
    (written or Sums(output, "unrecorded")).save_safetensors(output / ADAPTER_WEIGHTS, tensors, {"format": "pt"})
    model.peft_config["default"].save_pretrained(str(output))
    return (output / ADAPTER_WEIGHTS).stat().st_size
