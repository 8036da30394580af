"""The trainer's settings, declared once: the keys of the run's configuration that an update
reads, with their types, bounds and option names.

The run's configuration (config.py) holds them as its sections' own fields: ``UpdateSettings``
are the ``rl.*`` keys of the update (the ``rl`` section derives from it) and ``TrainerSettings``
the ``train.*`` keys of how the train workers compute (the ``train`` section derives from it).
The run validates them once, when its configuration is made; a train request (request.py)
carries their values under the same names (``{"rl": {...}, "train": {...}}``) and the trainer
decodes them with these same types. A field's error template names its key (``{key}``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated

import msgspec


def limit(error: str, **constraints) -> msgspec.Meta:
    """Constraints whose error is worded by ``error`` (formatted with ``key``, ``value`` and
    ``self``) rather than by the bounds alone."""
    return msgspec.Meta(**constraints, extra={"error": error})


def one_of(values: tuple[str, ...], what: str) -> msgspec.Meta:
    """A string that is one of ``values``; its error lists them."""
    return limit(f"{{key}}={{value!r}}: valid {what} are {', '.join(values)}",
                 pattern=rf"\A(?:{'|'.join(map(re.escape, values))})\Z")


ADVANTAGES = ("grpo", "dr_grpo", "rloo")
KL_ESTIMATORS = ("k1", "k2", "k3")
OLD_LOGPROBS = ("trainer", "engine")
LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
RATIO_LEVELS = ("token", "sequence")
OVERLONG = ("keep", "mask", "penalty")
IS_CORRECTIONS = ("auto", "none", "tis", "mis")
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama, Qwen2, Mistral and most decoder-only models."""

Count = Annotated[int, limit("{key} must be at least 1, got {value}", ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
LearningRate = Annotated[float, msgspec.Meta(gt=0)]
Epochs = Annotated[int, msgspec.Meta(ge=1)]
MicroBatch = Annotated[int, msgspec.Meta(ge=1)]
MicroBatchTokens = Annotated[int, limit("{key} must be >= 0 (0: no limit), got {value}", ge=0)]
ClipEps = Annotated[float, msgspec.Meta(gt=0)]
KLCoef = Annotated[float, msgspec.Meta(ge=0)]
MaxGradNorm = Annotated[float, msgspec.Meta(gt=0)]
ISCorrection = Annotated[str, one_of(IS_CORRECTIONS, "corrections")]
ISCap = Annotated[float, limit("{key} must be >= 1, got {value}", ge=1)]
DistillCoef = Annotated[float, limit("{key} must be >= 0 (0: no distillation), got {value}", ge=0)]
LoraRank = Annotated[int, limit("{key} must be >= 0 (0: no LoRA, the whole model is trained), got {value}", ge=0)]
LoraAlpha = Annotated[float, limit("{key} must be a positive number, got {value}", gt=0)]
LoraDropout = Annotated[float, limit("{key} must be in [0, 1), got {value}", ge=0, lt=1)]


@dataclass(kw_only=True)
class UpdateSettings:
    """The update's keys of the ``rl`` section."""

    lr: LearningRate = 3e-4
    """AdamW learning rate; the optimizer's moments carry over from one iteration to the next."""
    epochs: Epochs = 4
    """Passes over the iteration's trajectories per update."""
    micro_batch: MicroBatch = 48
    """Prompts (GRPO groups) per optimiser step, over all train workers: the update does not
    depend on how many there are (train/plan.py). Each worker accumulates its part of a step
    in micro-batches of train.micro_batch_tokens."""
    advantage: Annotated[str, one_of(ADVANTAGES, "advantages")] = "grpo"
    """How a group's rewards become advantages: grpo ((r - mean) / std), dr_grpo (r - mean,
    no std: Dr. GRPO), rloo (r minus the mean of the group's others). docs/rl.md."""
    clip_eps: ClipEps = 0.2
    """PPO clip range of the ratio, both sides unless rl.clip_eps_low or rl.clip_eps_high set one."""
    clip_eps_low: Annotated[float, limit("{key} must be >= 0 (0: rl.clip_eps), got {value}", ge=0)] = 0.0
    """The lower clip, 1 - this (0: rl.clip_eps)."""
    clip_eps_high: Annotated[float, limit("{key} must be >= 0 (0: rl.clip_eps), got {value}", ge=0)] = 0.0
    """The upper clip, 1 + this (0: rl.clip_eps); larger than the lower is DAPO's clip-higher (0.28 with 0.2)."""
    kl_coef: KLCoef = 0.0
    """Weight of the KL penalty to the base model (0: none)."""
    kl_estimator: Annotated[str, one_of(KL_ESTIMATORS, "estimators")] = "k3"
    """The per-token KL estimate: k1 (log ratio), k2 (half its square), k3 (exp(d) - d - 1)."""
    old_logprobs: Annotated[str, one_of(OLD_LOGPROBS, "sources")] = "trainer"
    """The old policy's log-probs in the PPO ratio: trainer (computed by the trainer, a forward
    pass over every sample before the first step) or engine (the engine's, kept in each
    record: no such pass; sound when the engine serves the trainer's weights at a close
    precision, as the embedded engine does in fp32). docs/rl.md."""
    loss_agg: Annotated[str, one_of(LOSS_AGGS, "aggregations")] = "token_mean"
    """How a step's per-token losses become one: token_mean (the mean over the step's tokens),
    seq_mean_token_sum (each sequence's token sum, averaged over sequences: Dr. GRPO),
    seq_mean_token_mean (each sequence's token mean, averaged: GRPO's paper, GSPO). docs/rl.md."""
    ratio_level: Annotated[str, one_of(RATIO_LEVELS, "levels")] = "token"
    """The PPO ratio per token, or per sequence (GSPO: the geometric mean of its tokens'
    ratios, clipped as one; use small clips, e.g. rl.clip_eps_low=0.0003, rl.clip_eps_high=0.0004)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: groups whose rewards do not vary (no advantage) leave the
    update, and the rollout draws further prompts until rl.train_tasks informative groups are
    in hand or rl.max_resample_rounds rounds are spent."""
    overlong: Annotated[str, one_of(OVERLONG, "choices")] = "keep"
    """Completions cut at rl.max_tokens: keep (trained as any), mask (out of the loss: DAPO's
    overlong filtering), penalty (every reward shaped by its length: DAPO's soft overlong
    punishment, falling from 0 to -1 over the last rl.overlong_buffer tokens)."""
    overlong_buffer: NonNegativeInt = 0
    """With rl.overlong=penalty: the tokens before rl.max_tokens over which the penalty ramps
    (0: a quarter of rl.max_tokens)."""
    max_grad_norm: MaxGradNorm = 1.0
    is_correction: ISCorrection = "auto"
    """Importance-sampling correction for the gap between the policy that sampled a token (the
    engine, whose log-prob the record keeps) and the policy the update starts from (the
    trainer's): each token's loss is weighed by their ratio, truncated at rl.is_cap (tis), or
    dropped where the ratio passes it (mis). none: no weight, the update as before. auto: tis
    when rl.max_staleness >= 1 (unless rl.old_logprobs=engine), else none."""
    is_cap: ISCap = 2.0
    """The largest importance weight rl.is_correction keeps."""
    max_tokens: Count = 8
    """Longest completion, in tokens."""
    distill_coef: DistillCoef = 0.0
    """On-policy distillation: the weight of the teacher's term in each token's advantage,
    distill_coef * (teacher log-prob - engine log-prob) of the sampled token, the per-token
    reverse KL to the teacher with its sign turned (prime-rl's, slime's OPD, Thinking Machines').
    Every sample then needs the teacher's log-probs (rl.teacher) and the engine's. 0: none."""
    distill_only: bool = False
    """With rl.distill_coef > 0: no reward term, each token's advantage is the teacher's term alone."""

    def check(self) -> None:
        """The rules between fields; ValueError naming the keys."""
        if self.overlong_buffer > self.max_tokens:
            raise ValueError(f"rl.overlong_buffer={self.overlong_buffer} is longer than rl.max_tokens={self.max_tokens}: the "
                             f"penalty ramps over the last rl.overlong_buffer tokens of a completion; set it at most rl.max_tokens")
        if self.old_logprobs == "engine" and self.is_correction not in ("auto", "none"):
            raise ValueError(f"rl.is_correction={self.is_correction} weighs by the trainer's log-probs over the engine's, and "
                             f"rl.old_logprobs=engine makes them the same: nothing is left to correct; set one of them back")
        if self.distill_only and self.distill_coef <= 0:
            raise ValueError("rl.distill_only makes the teacher's term the whole advantage, and rl.distill_coef=0 gives it no "
                             "weight: set rl.distill_coef > 0 (e.g. rl.distill_coef=1), or rl.distill_only=false")
        if self.distill_only and self.filter_groups:
            raise ValueError("rl.filter_groups leaves out the groups whose rewards do not vary, and rl.distill_only trains on "
                             "no reward: every group has the teacher's term to learn from; set rl.filter_groups=false")

    @property
    def overlong_ramp(self) -> int:
        """rl.overlong_buffer resolved: 0 is a quarter of rl.max_tokens (at least 1)."""
        return self.overlong_buffer or max(1, self.max_tokens // 4)

    @property
    def clip(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        return self.clip_eps_low or self.clip_eps, self.clip_eps_high or self.clip_eps


@dataclass(kw_only=True)
class TrainerSettings:
    """The ``train`` section's keys of how the train workers compute."""

    strategy: Annotated[str, one_of(STRATEGIES, "strategies")] = "ddp"
    """"ddp": every train worker holds the whole model, gradients and optimizer state. "fsdp":
    FSDP2, each holds 1/N of them, and the checkpoint is written as one shard per worker
    (docs/training.md)."""
    mixed_precision: Annotated[str, one_of(PRECISIONS, "values")] = "fp32"
    """"bf16": compute in bfloat16. Master weights, gradient reduction and optimizer state are
    fp32 either way, whatever dtype the model was saved in (train/precision.py)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them."""
    micro_batch_tokens: MicroBatchTokens = 16384
    """Most tokens (padding included) in one micro-batch; a worker accumulates gradients over
    as many as its part of an optimizer step needs. 0: its whole part at once. The update is
    the same whatever this is (the loss is the token mean over the whole step)."""
    packing: bool = True
    """Sequences packed one after another into rows as wide as the longest, attention never
    crossing from one to the next (position ids restart at each). false: one a row, padded to
    the longest. The update is the same either way, up to floating-point order; packed it
    computes little padding (docs/training.md, "Packing")."""
    lora_rank: LoraRank = 0
    """LoRA (peft): train rank-r adapters on the base model's projections, the base frozen; each
    checkpoint is the adapter, megabytes, and engines take it without reloading the base
    (docs/training.md, "LoRA"). 0: off, the whole model is trained."""
    lora_alpha: LoraAlpha = 32.0
    """The adapters' scale: their product is multiplied by lora_alpha / lora_rank."""
    lora_dropout: LoraDropout = 0.0
    """Dropout on the adapters' input in the update's forward passes (not in the log-probs of
    the old policy and the reference)."""
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """The modules that get an adapter, by name (as peft matches them), e.g.
    train.lora_target_modules=q_proj,v_proj; or all-linear. Default: the attention and MLP
    projections."""

    def check(self) -> None:
        """Normalizes ``lora_target_modules`` (a comma list is split); ValueError when it is empty."""
        names = [n.strip() for item in self.lora_target_modules for n in item.split(",") if n.strip()]
        if not names:
            raise ValueError("train.lora_target_modules is empty: name the modules that get an adapter, e.g. "
                             "train.lora_target_modules=q_proj,v_proj, or all-linear")
        self.lora_target_modules = list(dict.fromkeys(names))
