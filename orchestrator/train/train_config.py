"""The request the orchestrator writes for one update (JSON, one file per train worker and
iteration): ``TrainConfig``. Its bounds are the run config's own types (config.py), so a
value the run refuses is refused here alike; a bad value is named by its key, so the rank's
error says which one to fix."""

from __future__ import annotations

import json
import logging
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from orchestrator.config import (
    LORA_TARGET_MODULES,
    ClipEps,
    Epochs,
    ISCap,
    ISCorrection,
    KLCoef,
    LearningRate,
    LoraAlpha,
    LoraDropout,
    LoraRank,
    MaxGradNorm,
    MicroBatch,
    MicroBatchTokens,
)
from orchestrator.train.errors import BadTrainInput

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Built by ``from_json`` or ``read``, which check every field's type and bounds (msgspec)."""

    iteration: Annotated[int, msgspec.Meta(ge=0)]
    """The RL iteration this update belongs to (for logs and stats)."""
    data: Path
    """The trajectory aggregate (.jsonl), one record per task (format: ``grpo``)."""
    init_checkpoint: Path
    """Hugging Face directory the policy starts from; also the 'old' policy of the ratio."""
    reference_checkpoint: Path | None
    """Hugging Face directory of the KL reference, or None for no KL term."""
    output: Path
    """Staging directory for the new checkpoint (rank 0 writes it)."""
    seed: int
    """Seeds torch and the per-epoch shuffle (same on every rank)."""
    lr: LearningRate
    """AdamW learning rate (no weight decay, no schedule: one update per iteration)."""
    epochs: Epochs
    """Passes over the aggregate."""
    micro_batch: MicroBatch
    """Records (whole groups) per optimizer step, over all workers (train/plan.py)."""
    clip_eps: ClipEps
    """PPO clip range of the ratio."""
    kl_coef: KLCoef
    """Weight of the k3 KL term; 0 turns it off."""
    max_grad_norm: MaxGradNorm
    """Gradient-norm clip."""
    init_iteration: int | None = None
    """The iteration whose update ``init_checkpoint`` holds (None: the base model). A serving
    trainer that made that update continues from memory instead of loading it."""
    micro_batch_tokens: MicroBatchTokens = 0
    """A worker's micro-batches, which it accumulates gradients over, hold at most this many
    tokens, padding included (0: a worker's part of a step is one micro-batch)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the workers share the model (train/parallel.py)."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False
    parallel_write: bool = True
    """With fsdp: every worker writes its shard of the checkpoint (false: worker 0 writes it all)."""
    offload: bool = False
    """After the update, move the model and optimizer state to host memory (and back at the
    next request), so that engines sharing the GPU have its memory while they run."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    clip_eps_low: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """The lower clip (0: ``clip_eps``)."""
    clip_eps_high: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """The upper clip (0: ``clip_eps``)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """Where the ratio's old log-probs come from: the trainer's forward pass, or each sample's
    ``logprobs`` (the engine's)."""
    is_correction: ISCorrection = "none"
    """Weigh each token's loss by exp(init policy's log-prob - the engine's), the engine's from
    each sample's ``logprobs``: truncated at ``is_cap`` (tis), or 0 past it (mis)."""
    is_cap: ISCap = 2.0
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    """How the per-token losses of a step become one (grpo.token_scale)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """The PPO ratio per token, or GSPO's length-normalised one per sequence (grpo.log_ratio)."""
    overlong: Literal["keep", "mask", "penalty"] = "keep"
    """Completions cut at ``max_tokens``: trained as any (keep), out of the loss (mask); or
    every reward shaped by its length (penalty, grpo.overlong_penalty)."""
    overlong_buffer: Annotated[int, msgspec.Meta(ge=1)] = 1
    """With ``penalty``: the tokens before ``max_tokens`` over which it ramps to -1."""
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """The rollout's longest completion (needed by ``penalty``)."""
    filter_groups: bool = False
    """Leave out of the update the groups whose rewards do not vary (zero advantage)."""
    lora_rank: LoraRank = 0
    """LoRA adapters of this rank on ``lora_target_modules``, the base frozen (train/lora.py); 0: off."""
    lora_alpha: LoraAlpha = 32.0
    lora_dropout: LoraDropout = 0.0
    lora_target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    base_model: Path | None = None
    """With LoRA: the base model's directory on this node, which ``init_checkpoint`` (an
    adapter, after the first iteration) applies to."""

    def __post_init__(self) -> None:
        if self.lora_rank and self.base_model is None:
            raise ValueError("lora_rank > 0 needs base_model, the directory the adapters apply to")
        if self.overlong == "penalty" and not self.overlong_buffer <= self.max_tokens:
            raise ValueError(f"overlong=penalty needs 1 <= overlong_buffer <= max_tokens, got {self.overlong_buffer} and {self.max_tokens}")

    @property
    def uses_kl(self) -> bool:
        return self.kl_coef > 0 and self.reference_checkpoint is not None

    @property
    def clip(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        return self.clip_eps_low or self.clip_eps, self.clip_eps_high or self.clip_eps

    @property
    def engine_logprobs_needed(self) -> str | None:
        """What needs each sample's engine log-probs, or None."""
        if self.old_logprobs == "engine":
            return "old_logprobs=engine"
        if self.is_correction != "none":
            return f"is_correction={self.is_correction}"
        return None

    @classmethod
    def from_json(cls, raw: object) -> "TrainConfig":
        """Raises ValueError naming the key at fault."""
        if not isinstance(raw, dict):
            raise ValueError("the train config is not a JSON object")
        names = [f.name for f in fields(cls)]
        missing = [f.name for f in fields(cls) if f.name not in raw and f.default is MISSING]
        if missing:
            raise ValueError(f"the train config lacks {', '.join(missing)}")
        unknown = sorted(set(raw) - set(names))
        if unknown:
            log.warning("ignoring unknown train config keys: %s", ", ".join(unknown))
        _check_each_key(raw, typing.get_type_hints(cls, include_extras=True))
        try:
            return msgspec.convert(raw, cls, dec_hook=_absolute_path)
        except msgspec.ValidationError as e:
            raise ValueError(f"the train config: {e}") from None

    @classmethod
    def read(cls, path: Path) -> "TrainConfig":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls.from_json(raw)
        except (OSError, ValueError) as e:
            raise BadTrainInput(f"train config {path}: {e}") from None


def _check_each_key(raw: dict, types: dict[str, object]) -> None:
    """Decode each known key on its own, in the order ``raw`` has them (the order msgspec
    meets them in), so the first bad one is named by its key; its own decode's message says
    what is wrong without a location in it to strip."""
    for name, value in raw.items():
        if name not in types:
            continue
        try:
            msgspec.convert(value, types[name], dec_hook=_absolute_path)
        except msgspec.ValidationError as e:
            raise ValueError(f"train config key {name!r} is {value!r}: {e}") from None


def _absolute_path(type_: type, value: object) -> Path:
    """msgspec's decoder of the ``Path`` fields: absolute paths only."""
    if type_ is not Path:
        raise NotImplementedError(type_)
    if not isinstance(value, str):
        raise TypeError(f"Expected `str`, got `{type(value).__name__}`")
    if not Path(value).is_absolute():
        raise ValueError("must be an absolute path")
    return Path(value)
