"""GRPO as pure functions: records, group advantages, batching, token log-probs and the loss
(how records are split over workers, steps and micro-batches: train/plan.py).

The trajectory aggregate is JSON lines, one record per task, and a record's samples are
one GRPO group::

    {"task_id": "train-000042", "prompt": "17+25=", "prompt_token_ids": [1, 5, 11, 6, 9, 10, 17],
     "answer": "42",
     "samples": [{"text": "42", "token_ids": [8, 6, 2], "reward": 1.0, "finish_reason": "stop",
                  "logprobs": [...]}, ...]}

Other keys may be present and are ignored. The trainer computes the old policy's log-probs
itself, so that the PPO ratio compares like with like; the engine's ``logprobs`` (one per
``token_ids`` entry, the log-prob of each sampled token under the policy that sampled it) are
read for the importance-sampling correction (``is_weights``), and ignored without it.

Token layout of one sample: the trainer trains on the ids the engine sampled, never on the
text re-tokenized (a BPE tokenizer can tokenize a sampled text differently, which would
silently break the importance ratio): ``prompt_token_ids``, then the sample's ``token_ids``,
which end with the EOS token when the engine stopped on it. A record written without ids (by
hand) is tokenized from its text instead: ``tokenizer(prompt)``, then
``tokenizer(text, add_special_tokens=False)``, then EOS when ``finish_reason == "stop"``.

Every per-token tensor here (log-probs, old and reference log-probs, advantages) is flat,
holding the completion tokens of a batch in (sequence, position) order: the order in which
``tensor[target_mask]`` reads a right-padded batch. Concatenating per-record tensors in
batch order therefore lines them up with the batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

FINISH_REASONS = ("stop", "length")
STD_EPS = 1e-6


# --- records -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    text: str
    reward: float
    finish_reason: str  # one of FINISH_REASONS
    token_ids: tuple[int, ...] | None = None
    """The ids the engine sampled; None in a record written without them."""
    logprobs: tuple[float, ...] | None = None
    """The engine's log-prob of each of ``token_ids``; None when the record has none that fit."""


@dataclass(frozen=True, slots=True)
class Record:
    """One task and its group of sampled completions."""

    task_id: str
    prompt: str
    samples: tuple[Sample, ...]
    prompt_token_ids: tuple[int, ...] | None = None
    """The prompt as the engine tokenized it; when set, every sample has its ``token_ids``."""


def _token_ids(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ValueError(f"{what} must be a list of token ids (non-negative integers)")
    return tuple(value)


def _logprobs(value, ids: tuple[int, ...] | None) -> tuple[float, ...] | None:
    """The engine's log-probs when they are one finite number per sampled id, else None (a
    record without them trains as before; the correction that needs them says so)."""
    if ids is None or not isinstance(value, list) or len(value) != len(ids):
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value):
        return None
    return tuple(float(x) for x in value)


def parse_record(obj: object) -> Record:
    """A record from one decoded JSON line; raises ValueError saying which field is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for key in ("task_id", "prompt"):
        if not isinstance(obj.get(key), str):
            raise ValueError(f"{key!r} must be a string")
    raw = obj.get("samples")
    if not isinstance(raw, list) or not raw:
        raise ValueError("'samples' must be a non-empty list")
    prompt_ids = None if obj.get("prompt_token_ids") is None else _token_ids(obj["prompt_token_ids"], "'prompt_token_ids'")
    if prompt_ids is not None and not prompt_ids:
        raise ValueError("'prompt_token_ids' must not be empty")
    samples = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise ValueError(f"samples[{i}] is not an object")
        if not isinstance(s.get("text"), str):
            raise ValueError(f"samples[{i}].text must be a string")
        reward = s.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"samples[{i}].reward must be a finite number, got {reward!r}")
        if s.get("finish_reason") not in FINISH_REASONS:
            raise ValueError(f"samples[{i}].finish_reason must be one of {FINISH_REASONS}, got {s.get('finish_reason')!r}")
        ids = None
        if prompt_ids is not None:
            if s.get("token_ids") is None:
                raise ValueError(f"samples[{i}].token_ids is missing, but the record has prompt_token_ids")
            ids = _token_ids(s["token_ids"], f"samples[{i}].token_ids")
        samples.append(Sample(s["text"], float(reward), s["finish_reason"], ids, _logprobs(s.get("logprobs"), ids)))
    return Record(obj["task_id"], obj["prompt"], tuple(samples), prompt_ids)


def read_records(path: Path) -> list[Record]:
    """Records of an aggregate file in file order; raises ValueError naming ``path:line``."""
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{n}: bad trajectory record: {e}") from None
    return records


# --- advantages ----------------------------------------------------------------------------


ADVANTAGES = ("grpo", "dr_grpo", "rloo")


def group_advantages(rewards: Sequence[float], kind: str = "grpo") -> list[float]:
    """The advantages of one group's samples.

    - ``grpo``: ``(r - mean) / (std + 1e-6)``, the population std (Shao et al. 2024).
    - ``dr_grpo``: ``r - mean``, no division by the std, which weighs groups of low variance
      (too easy or too hard) up (Liu et al. 2025, "Understanding R1-Zero-like training").
    - ``rloo``: ``r`` minus the mean of the group's other samples, ``n / (n - 1) (r - mean)``,
      an unbiased leave-one-out baseline (Ahmadian et al. 2024); 0 for a group of one.

    A group whose rewards are all equal carries no signal: its advantages are exactly zero
    (computed, ``r - mean`` can be a rounding error that ``1e-6`` would blow up).
    """
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    n = len(rewards)
    mean = sum(rewards) / n
    if kind == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
        return [(r - mean) / (std + STD_EPS) for r in rewards]
    if kind == "dr_grpo":
        return [r - mean for r in rewards]
    if kind == "rloo":
        return [n / (n - 1) * (r - mean) for r in rewards]
    raise ValueError(f"advantage must be one of {', '.join(ADVANTAGES)}, got {kind!r}")


# --- batching ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample as token ids, with its group-normalised advantage."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    behaviour_logprobs: tuple[float, ...] | None = None
    """The engine's log-prob of each completion token (None: not recorded)."""


def encode_record(tokenizer, record: Record, advantage: str = "grpo") -> list[Completion]:
    """The record's samples as token ids, in sample order: the engine's ids when the record
    has them, else its text tokenized (layout: module docstring)."""
    advantages = group_advantages([s.reward for s in record.samples], advantage)
    if record.prompt_token_ids is not None:
        return [Completion(record.prompt_token_ids, s.token_ids, a, s.logprobs) for s, a in zip(record.samples, advantages)]
    prompt = tuple(tokenizer(record.prompt)["input_ids"])
    texts = [s.text for s in record.samples]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = []
    for sample, ids, advantage in zip(record.samples, encoded, advantages):
        ids = list(ids) + ([tokenizer.eos_token_id] if sample.finish_reason == "stop" else [])
        out.append(Completion(prompt, tuple(ids), advantage))
    return out


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: "torch.Tensor"  # [B, T] long, right-padded
    attention_mask: "torch.Tensor"  # [B, T] long
    target_mask: "torch.Tensor"  # [B, T-1] bool: input_ids[:, 1:] is a completion token
    advantages: "torch.Tensor"  # [N] float32, one per completion token

    @property
    def num_tokens(self) -> int:
        return self.advantages.numel()

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.target_mask, self.advantages)))


def collate(completions: Sequence[Completion], pad_id: int) -> Batch:
    """Right-pad completions into one batch (right padding keeps the default position ids right)."""
    import torch

    rows = [c.prompt_ids + c.completion_ids for c in completions]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    target_mask = torch.zeros((len(rows), max(width - 1, 0)), dtype=torch.bool)
    advantages = []
    for i, (c, row) in enumerate(zip(completions, rows)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
        # target position t predicts input_ids[t + 1]: the completion starts at len(prompt) - 1
        target_mask[i, len(c.prompt_ids) - 1 : len(row) - 1] = True
        advantages.extend([c.advantage] * len(c.completion_ids))
    return Batch(input_ids, attention_mask, target_mask, torch.tensor(advantages, dtype=torch.float32))


# --- log-probs and loss --------------------------------------------------------------------


def completion_logprobs(model, batch: Batch) -> "torch.Tensor":
    """``log p(token | prefix)`` of every completion token, flat [N], in float32.

    Only the completion positions' logits go through log_softmax, which keeps the [N, vocab]
    float32 copy as small as the completions are.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    picked = logits[:, :-1][batch.target_mask].float()
    targets = batch.input_ids[:, 1:][batch.target_mask]
    return picked.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps: float, clip_eps_high: float | None = None):
    """Per token ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)``, ``ratio = exp(new -
    old)``; ``eps_high`` defaults to ``eps`` (symmetric). A larger ``eps_high`` is DAPO's
    clip-higher (Yu et al. 2025): room for unlikely tokens to gain, against entropy collapse."""
    import torch

    ratio = (logprobs - old_logprobs).exp()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + high) * advantages)


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs, ref_logprobs, estimator: str = "k3"):
    """Per token estimate of KL(policy || reference) from tokens sampled by the policy, with
    ``d = ref - new`` (Schulman, "Approximating KL divergence", 2020):

    - ``k1``: ``-d``, unbiased, but negative on some tokens and of high variance;
    - ``k2``: ``d^2 / 2``, non-negative, biased, low variance; its gradient is that of the
      KL's reverse direction to second order;
    - ``k3``: ``exp(d) - d - 1``, non-negative, unbiased, low variance (the default).
    """
    d = ref_logprobs - logprobs
    if estimator == "k3":
        return d.exp() - d - 1
    if estimator == "k2":
        return d.square() / 2
    if estimator == "k1":
        return -d
    raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def k3_kl(logprobs, ref_logprobs):
    """Per token k3 estimate of KL(policy || reference): ``exp(d) - d - 1``, ``d = ref - new``.

    Non-negative, zero where the two agree, and unbiased for tokens sampled from the policy.
    """
    return kl_estimate(logprobs, ref_logprobs, "k3")


def is_weights(old_logprobs, behaviour_logprobs, *, mode: str, cap: float):
    """Per token, the importance weight of the policy the update starts from against the one
    that sampled the token, ``ratio = exp(old - behaviour)``: ``tis`` truncates it at ``cap``
    (truncated importance sampling), ``mis`` keeps it up to ``cap`` and zeroes the token past
    it (masked importance sampling). Returns (weights, ratios), both detached."""
    import torch

    ratio = (old_logprobs - behaviour_logprobs).detach().exp()
    if mode == "tis":
        return ratio.clamp(max=cap), ratio
    if mode == "mis":
        return torch.where(ratio > cap, torch.zeros_like(ratio), ratio), ratio
    raise ValueError(f"is_correction must be tis or mis here, got {mode!r}")


@dataclass(frozen=True, slots=True)
class LossParts:
    loss: "torch.Tensor"  # scalar, differentiable
    kl: float | None  # token-mean KL estimate when the KL term is on
    clip_fraction: float  # share of tokens whose ratio left [1 - eps, 1 + eps]
    tokens: int


def grpo_loss(logprobs, old_logprobs, advantages, *, clip_eps: float, kl_coef: float = 0.0, ref_logprobs=None,
              normalizer: float | None = None, weights=None, clip_eps_high: float | None = None,
              kl_estimator: str = "k3") -> LossParts:
    """Token-mean over the batch of ``-weights * clipped_surrogate + kl_coef * k3``; with
    ``normalizer`` the tokens' sum divided by it instead (a micro-batch's share of a larger
    batch's mean). ``weights``: per-token importance weights (:func:`is_weights`), or None.
    ``clip_eps_high``: the upper clip (default ``clip_eps``); ``kl_estimator``: k1, k2 or k3.

    The KL term is on only with ``kl_coef > 0`` and reference log-probs. A batch without
    completion tokens gives a zero loss that is still attached to the graph, so every rank
    runs the same backward (DDP needs that).
    """
    import torch

    per_token = -clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high)
    if weights is not None:
        per_token = per_token * weights
    kl = None
    if kl_coef > 0 and ref_logprobs is not None:
        estimate = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * estimate
        kl = estimate.detach().mean().item() if estimate.numel() else 0.0
    n = per_token.numel()
    with torch.no_grad():
        ratio = (logprobs - old_logprobs).exp()
        clipped = (ratio < 1 - clip_eps) | (ratio > 1 + (clip_eps if clip_eps_high is None else clip_eps_high))
        clip_fraction = clipped.float().mean().item() if n else 0.0
    return LossParts(per_token.sum() / (max(n, 1) if normalizer is None else normalizer), kl, clip_fraction, n)
