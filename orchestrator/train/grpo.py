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


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """``(r - mean) / (std + 1e-6)`` within one group, with the population std.

    A group whose rewards are all equal carries no signal: its advantages are exactly zero
    (computed, ``r - mean`` can be a rounding error that ``1e-6`` would blow up). The
    population std keeps a group of one well defined (it is all-equal, so zero).
    """
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + STD_EPS) for r in rewards]


# --- batching ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample as token ids, with its group-normalised advantage."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    behaviour_logprobs: tuple[float, ...] | None = None
    """The engine's log-prob of each completion token (None: not recorded)."""


def encode_record(tokenizer, record: Record) -> list[Completion]:
    """The record's samples as token ids, in sample order: the engine's ids when the record
    has them, else its text tokenized (layout: module docstring)."""
    advantages = group_advantages([s.reward for s in record.samples])
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


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps: float):
    """Per token ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``, ``ratio = exp(new - old)``."""
    import torch

    ratio = (logprobs - old_logprobs).exp()
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)


def k3_kl(logprobs, ref_logprobs):
    """Per token k3 estimate of KL(policy || reference): ``exp(d) - d - 1``, ``d = ref - new``.

    Non-negative, zero where the two agree, and unbiased for tokens sampled from the policy.
    """
    d = ref_logprobs - logprobs
    return d.exp() - d - 1


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
    kl: float | None  # token-mean k3 when the KL term is on
    clip_fraction: float  # share of tokens whose ratio left [1 - eps, 1 + eps]
    tokens: int


def grpo_loss(logprobs, old_logprobs, advantages, *, clip_eps: float, kl_coef: float = 0.0, ref_logprobs=None,
              normalizer: float | None = None, weights=None) -> LossParts:
    """Token-mean over the batch of ``-weights * clipped_surrogate + kl_coef * k3``; with
    ``normalizer`` the tokens' sum divided by it instead (a micro-batch's share of a larger
    batch's mean). ``weights``: per-token importance weights (:func:`is_weights`), or None.

    The KL term is on only with ``kl_coef > 0`` and reference log-probs. A batch without
    completion tokens gives a zero loss that is still attached to the graph, so every rank
    runs the same backward (DDP needs that).
    """
    import torch

    per_token = -clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps)
    if weights is not None:
        per_token = per_token * weights
    kl = None
    if kl_coef > 0 and ref_logprobs is not None:
        k3 = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + kl_coef * k3
        kl = k3.detach().mean().item() if k3.numel() else 0.0
    n = per_token.numel()
    with torch.no_grad():
        clipped = ((logprobs - old_logprobs).exp() - 1).abs() > clip_eps
        clip_fraction = clipped.float().mean().item() if n else 0.0
    return LossParts(per_token.sum() / (max(n, 1) if normalizer is None else normalizer), kl, clip_fraction, n)
