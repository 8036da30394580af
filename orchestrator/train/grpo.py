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

A multi-turn sample (one that an environment answered between turns) carries ``loss_mask``, one 0 or 1 per
``token_ids`` entry: its ids are every turn's sampled ids and, between them, the ids of the
environment's observations, which are context, not trained (0); its ``logprobs`` hold 0.0 there.

On-policy distillation (``rl.distill_coef``): a sample (and each of an agent sample's
``segments``) also carries ``teacher_logprobs``, one per ``token_ids`` entry, the teacher's
log-prob of each sampled token (0.0 where ``loss_mask`` is 0); each token's advantage then
takes the teacher's term (:func:`token_advantages`).

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

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from orchestrator.train.settings import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGS, RATIO_LEVELS

if TYPE_CHECKING:
    import torch

FINISH_REASONS = ("stop", "length")
STD_EPS = 1e-6


# --- records -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segment:
    """An earlier part of a sample that its agent did not extend (it rewrote its history):
    trained as a sequence of its own, with its sample's advantage."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    loss_mask: tuple[int, ...] | None = None
    teacher_logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    text: str
    reward: float
    finish_reason: str  # one of FINISH_REASONS
    token_ids: tuple[int, ...] | None = None
    """The ids the engine sampled; None in a record written without them."""
    logprobs: tuple[float, ...] | None = None
    """The engine's log-prob of each of ``token_ids``; None when the record has none that fit."""
    loss_mask: tuple[int, ...] | None = None
    """Per id of ``token_ids``: 1 where the engine sampled it (trained), 0 where it is context
    the rollout put there (an environment's observation in a multi-turn sample); None: all 1."""
    segments: tuple[Segment, ...] = ()
    """The sample's earlier segments (an agent's rewritten history), before its own ids."""
    teacher_logprobs: tuple[float, ...] | None = None
    """The teacher's log-prob of each of ``token_ids`` (on-policy distillation); None when the
    record has none that fit."""


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
    """The engine's (or the teacher's) log-probs when they are one finite number per sampled
    id, else None (a record without them trains as before; the option that needs them says so)."""
    if ids is None or not isinstance(value, list) or len(value) != len(ids):
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value):
        return None
    return tuple(float(x) for x in value)


def _loss_mask(value, ids: tuple[int, ...] | None, i: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    if ids is None:
        raise ValueError(f"samples[{i}].loss_mask needs the sample's token_ids (and the record's prompt_token_ids)")
    if not isinstance(value, list) or len(value) != len(ids) or not all(m in (0, 1) and not isinstance(m, bool) for m in value):
        raise ValueError(f"samples[{i}].loss_mask must be a list of 0 and 1, one per token id ({len(ids)})")
    return None if all(value) else tuple(value)


def _segments(value, prompt_ids: tuple[int, ...] | None, i: int) -> tuple[Segment, ...]:
    if not value:
        return ()
    if prompt_ids is None or not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"samples[{i}].segments must be a list of objects, in a record with prompt_token_ids")
    out = []
    for j, seg in enumerate(value):
        where = f"samples[{i}].segments[{j}]"
        prompt = _token_ids(seg.get("prompt_token_ids"), f"{where}.prompt_token_ids")
        if not prompt:
            raise ValueError(f"{where}.prompt_token_ids must not be empty")
        ids = _token_ids(seg.get("token_ids"), f"{where}.token_ids")
        out.append(Segment(prompt, ids, _logprobs(seg.get("logprobs"), ids), _loss_mask(seg.get("loss_mask"), ids, i),
                           _logprobs(seg.get("teacher_logprobs"), ids)))
    return tuple(out)


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
        samples.append(Sample(s["text"], float(reward), s["finish_reason"], ids, _logprobs(s.get("logprobs"), ids),
                              _loss_mask(s.get("loss_mask"), ids, i), _segments(s.get("segments"), prompt_ids, i),
                              _logprobs(s.get("teacher_logprobs"), ids)))
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


@dataclass(frozen=True, slots=True)
class Distillation:
    """On-policy distillation's share of the advantage (``rl.distill_coef``, ``rl.distill_only``)."""

    coef: float = 0.0
    only: bool = False
    """No reward term: each token's advantage is the teacher's term alone."""


def token_advantages(advantage: float, behaviour: Sequence[float], teacher: Sequence[float],
                     loss_mask: Sequence[int] | None, distillation: Distillation) -> tuple[float, ...]:
    """Each completion token's advantage under on-policy distillation (Agarwal et al. 2024;
    Thinking Machines' "On-policy distillation", prime-rl's and slime's OPD):
    ``A_t = A + coef * (q_t - s_t)``, with ``A`` the sample's group advantage, ``s_t`` the
    engine's (the behaviour policy's) log-prob of the sampled token and ``q_t`` the
    teacher's: minus the per-token reverse KL to the teacher, the sample's own estimate of
    it. With ``only`` the reward's term is left out, ``A_t = coef * (q_t - s_t)``. A token
    with ``loss_mask`` 0 (context, not sampled) takes no teacher's term.

    How it composes with the update's other options, each unchanged and applied to the whole
    ``A_t``: the loss of a token is ``-w_t * min(r A_t, clip(r) A_t)`` (``rl.is_correction``'s
    weight ``w_t``; ``r`` the token's ratio, or with ``rl.ratio_level=sequence`` its
    sequence's, the same ``r`` for every token, each keeping its own ``A_t``), aggregated by
    ``rl.loss_agg``, plus the reference KL term (``rl.kl_coef``) as before. ``s_t`` is the
    sampling policy's, fixed for the iteration (the teacher's term is a reward per token, not
    a loss to differentiate). ``rl.overlong=penalty`` shapes the rewards, so ``A`` alone, and
    nothing with ``only``; ``rl.overlong=mask`` keeps a cut sample out of the loss whole, its
    teacher's term too. An agent's earlier segment takes its sample's ``A`` and its own
    tokens' terms."""
    base = 0.0 if distillation.only else advantage
    mask = loss_mask or (1,) * len(teacher)
    return tuple(base + distillation.coef * (q - s) if m else base for s, q, m in zip(behaviour, teacher, mask, strict=True))


# --- batching ------------------------------------------------------------------------------




def overlong_penalty(length: int, *, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to a sample's reward: 0 up to
    ``max_tokens - buffer`` tokens, then falling linearly to -1 at ``max_tokens``; -1 past it."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length > max_tokens:
        return -1.0
    return (start - length) / buffer


def informative(record: Record) -> bool:
    """Whether the group's rewards vary: a group whose samples all scored alike has zero
    advantage, and ``rl.filter_groups`` leaves it out of the update."""
    rewards = [s.reward for s in record.samples]
    return max(rewards) != min(rewards)


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample as token ids, with its group-normalised advantage."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    behaviour_logprobs: tuple[float, ...] | None = None
    """The engine's log-prob of each completion token (None: not recorded)."""
    trained: bool = True
    """False: the sample's tokens are in the batch (the group's advantage counts it) but out
    of the loss (``rl.overlong=mask`` on a completion cut at ``rl.max_tokens``)."""
    loss_mask: tuple[int, ...] | None = None
    """Per completion token, whether it is in the loss (``Sample.loss_mask``); None: all are."""
    teacher_logprobs: tuple[float, ...] | None = None
    """The teacher's log-prob of each completion token (on-policy distillation), or None."""
    token_advantages: tuple[float, ...] | None = None
    """Per completion token, its advantage when they differ (:func:`token_advantages`); None:
    each is ``advantage``."""

    def trained_tokens(self) -> int:
        """How many of its tokens the loss counts."""
        if not self.trained:
            return 0
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)


@dataclass(frozen=True, slots=True)
class Shaping:
    """What the update does with completions cut at ``max_tokens`` (``rl.overlong``)."""

    overlong: str = "keep"
    max_tokens: int = 0
    buffer: int = 0


def encode_record(tokenizer, record: Record, advantage: str = "grpo", shaping: Shaping = Shaping(),
                  distillation: Distillation = Distillation()) -> list[Completion]:
    """The record's samples as token ids, in sample order: the engine's ids when the record
    has them, else its text tokenized (layout: module docstring). With ``penalty`` each
    reward takes :func:`overlong_penalty` of its length before the advantages; with ``mask``
    a sample cut at the length limit (``finish_reason == "length"``) is not trained. With a
    ``distillation`` coefficient every token takes the teacher's term (:func:`token_advantages`),
    which needs the engine's and the teacher's log-probs of every sample and segment
    (train/batches.py checks the records for them first; ValueError naming the task here)."""
    if record.prompt_token_ids is not None:
        prompt = record.prompt_token_ids
        ids = [s.token_ids for s in record.samples]
    else:
        prompt = tuple(tokenizer(record.prompt)["input_ids"])
        encoded = tokenizer([s.text for s in record.samples], add_special_tokens=False)["input_ids"]
        ids = [tuple(e) + ((tokenizer.eos_token_id,) if s.finish_reason == "stop" else ()) for s, e in zip(record.samples, encoded)]
    rewards = [s.reward for s in record.samples]
    if shaping.overlong == "penalty":
        rewards = [r + overlong_penalty(len(i), max_tokens=shaping.max_tokens, buffer=shaping.buffer) for r, i in zip(rewards, ids)]
    advantages = [0.0] * len(rewards) if distillation.only else group_advantages(rewards, advantage)

    def per_token(a: float, part: Sample | Segment, where: str) -> tuple[float, ...] | None:
        if not distillation.coef:
            return None
        if part.logprobs is None or part.teacher_logprobs is None:
            raise ValueError(f"trajectory record {record.task_id} {where} lacks the engine's or the teacher's log-probs of its "
                             f"token_ids, which rl.distill_coef={distillation.coef:g} needs")
        return token_advantages(a, part.logprobs, part.teacher_logprobs, part.loss_mask, distillation)

    completions = [Completion(prompt, i, a, s.logprobs,
                              trained=not (shaping.overlong == "mask" and s.finish_reason == "length"), loss_mask=s.loss_mask,
                              teacher_logprobs=s.teacher_logprobs, token_advantages=per_token(a, s, f"sample {n}"))
                   for n, (s, i, a) in enumerate(zip(record.samples, ids, advantages))]
    # An agent's earlier segments: sequences of their own after the group's samples, each with its sample's advantage.
    return completions + [Completion(seg.prompt_ids, seg.token_ids, a, seg.logprobs, loss_mask=seg.loss_mask,
                                     teacher_logprobs=seg.teacher_logprobs, token_advantages=per_token(a, seg, f"sample {n} segment {j}"))
                          for n, (s, a) in enumerate(zip(record.samples, advantages)) for j, seg in enumerate(s.segments)]


def mean_reverse_kl(completions: Sequence[Completion]) -> float | None:
    """The mean over the tokens the loss counts of ``s_t - q_t``, the engine's log-prob of the
    sampled token less the teacher's: the sampled estimate of the per-token reverse KL from
    the policy to the teacher. None when no completion has the teacher's log-probs."""
    if all(c.teacher_logprobs is None for c in completions):
        return None
    total, tokens = 0.0, 0
    for c in completions:
        if c.teacher_logprobs is None or c.behaviour_logprobs is None or not c.trained:
            continue
        mask = c.loss_mask or (1,) * len(c.teacher_logprobs)
        total += sum(s - q for s, q, m in zip(c.behaviour_logprobs, c.teacher_logprobs, mask) if m)
        tokens += sum(mask)
    return total / max(tokens, 1)




@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: "torch.Tensor"  # [R, T] long: rows, each right-padded
    attention_mask: "torch.Tensor | None"  # [R, T] long; None in a packed batch (its position ids say where each sequence starts)
    target_mask: "torch.Tensor"  # [R, T-1] bool: input_ids[:, 1:] is a completion token
    advantages: "torch.Tensor"  # [N] float32, one per completion token
    lengths: "torch.Tensor"  # [S] long: each sequence's completion tokens, in order
    scale: "torch.Tensor | None" = None
    """[N] float32, each token's factor in the loss's sum (:func:`token_scale`); None: all 1."""
    mask: "torch.Tensor | None" = None
    """[N] float32, 1 for a token in the loss and 0 for one out of it; None: all are in."""
    position_ids: "torch.Tensor | None" = None
    """[R, T] long in a packed batch: each sequence's positions from 0, and the padding's after
    them as a sequence of its own, so attention never crosses from one to the next; None in
    a padded batch (one sequence a row, positions from 0)."""

    @property
    def num_tokens(self) -> int:
        return self.advantages.numel()

    def to(self, device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (self.input_ids, self.attention_mask, self.target_mask,
                                                                      self.advantages, self.lengths, self.scale, self.mask,
                                                                      self.position_ids)))


def token_mask(completions: Sequence[Completion]) -> list[float] | None:
    """Per completion token, 1 when the loss counts it and 0 when not (an untrained sample, an
    observation's token); None when the loss counts every token."""
    if all(c.trained and c.loss_mask is None for c in completions):
        return None
    out: list[float] = []
    for c in completions:
        out.extend(([0.0] * len(c.completion_ids)) if not c.trained else
                   ([1.0] * len(c.completion_ids)) if c.loss_mask is None else [float(m) for m in c.loss_mask])
    return out


def token_scale(completions: Sequence[Completion], loss_agg: str) -> list[float] | None:
    """Each completion token's factor in the loss's sum, which the step's normaliser then
    divides (train/plan.py: its tokens, or its sequences):

    - ``token_mean``: 1, the mean over the step's tokens (a long completion weighs more);
    - ``seq_mean_token_sum``: 1 over the step's sequences: each sequence's token sum, averaged
      (Dr. GRPO's unbiased sum, Liu et al. 2025, with a constant in place of its max length);
    - ``seq_mean_token_mean``: ``1 / length``, the mean of each sequence's token mean (the
      original GRPO and GSPO aggregation: every sequence weighs the same).

    A token out of the loss (:func:`token_mask`) has 0, and a sequence's length counts only
    its tokens in the loss. None when every factor is 1.
    """
    return _scale(completions, loss_agg, token_mask(completions))


def _scale(completions: Sequence[Completion], loss_agg: str, mask: list[float] | None) -> list[float] | None:
    """:func:`token_scale`, given the completions' :func:`token_mask`."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}, got {loss_agg!r}")
    if loss_agg != "seq_mean_token_mean":
        return mask
    out: list[float] = []
    start = 0
    for c in completions:
        n = len(c.completion_ids)
        own = [1.0] * n if mask is None else mask[start : start + n]
        start += n
        trained = sum(own)
        out.extend(m / trained if trained else 0.0 for m in own)
    return out


def collate(completions: Sequence[Completion], pad_id: int, loss_agg: str = "token_mean") -> Batch:
    """Right-pad completions into one batch, one a row (right padding keeps the default position ids right)."""
    return collate_rows([[c] for c in completions], pad_id, loss_agg)


def collate_rows(rows: Sequence[Sequence[Completion]], pad_id: int, loss_agg: str = "token_mean") -> Batch:
    """Completions laid out in rows, each row's one after another and the rows right-padded to
    the longest. A row of one completion is padded as :func:`collate` pads; when any row holds
    more, the batch is packed (``Batch.position_ids``). The flat per-token tensors follow the
    completions row by row."""
    import torch

    ids = [[t for c in row for t in c.prompt_ids + c.completion_ids] for row in rows]
    width = max(map(len, ids))
    packed = any(len(row) > 1 for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = None if packed else torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    target_mask = torch.zeros((len(rows), max(width - 1, 0)), dtype=torch.bool)
    advantages = []
    for r, (row, row_ids) in enumerate(zip(rows, ids)):
        input_ids[r, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        if attention_mask is not None:
            attention_mask[r, : len(row_ids)] = 1
        start = 0
        for c in row:
            n = len(c.prompt_ids) + len(c.completion_ids)
            if position_ids is not None:
                position_ids[r, start : start + n] = torch.arange(n)
            # target position t predicts input_ids[t + 1]: the completion starts at len(prompt) - 1
            target_mask[r, start + len(c.prompt_ids) - 1 : start + n - 1] = True
            advantages.extend(c.token_advantages if c.token_advantages is not None else [c.advantage] * len(c.completion_ids))
            start += n
        if position_ids is not None:
            position_ids[r, start:] = torch.arange(width - start)
    completions = [c for row in rows for c in row]
    lengths = torch.tensor([len(c.completion_ids) for c in completions], dtype=torch.long)
    mask = token_mask(completions)
    scale = _scale(completions, loss_agg, mask)
    return Batch(input_ids, attention_mask, target_mask, torch.tensor(advantages, dtype=torch.float32), lengths,
                 None if scale is None else torch.tensor(scale, dtype=torch.float32),
                 None if mask is None else torch.tensor(mask, dtype=torch.float32), position_ids)


# --- log-probs and loss --------------------------------------------------------------------


def completion_logprobs(model, batch: Batch, *, entropy: bool = False, head_at_targets: bool = False):
    """``log p(token | prefix)`` of every completion token, flat [N], in float32; with
    ``entropy`` also the policy's entropy at each of those positions (detached, [N]).

    Only the completion positions' logits go through log_softmax, which keeps the [N, vocab]
    float32 copy as small as the completions are. With ``head_at_targets`` (packed updates)
    the LM head itself runs only there (:func:`_head_at`): neither the prompt's positions nor
    the padding's pay for a projection onto the whole vocabulary. (Its values then differ
    from the whole head's in the last bits, so the padded update keeps the whole head and,
    with it, the curves measured before packing.)
    """
    import torch

    forward = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    if head_at_targets:
        with _head_at(model, batch.target_mask):
            picked = model(**forward).logits[0].float()
    else:
        picked = model(**forward).logits[:, :-1][batch.target_mask].float()
    targets = batch.input_ids[:, 1:][batch.target_mask]
    logp = picked.log_softmax(-1)
    chosen = logp.gather(-1, targets[:, None]).squeeze(-1)
    if not entropy:
        return chosen
    with torch.no_grad():  # a slice of rows at a time: at most ENTROPY_ROWS x vocab more floats than the forward holds
        return chosen, torch.cat([-(rows.exp() * rows).sum(-1) for rows in logp.detach().split(ENTROPY_ROWS)] or [logp.new_zeros(0)])


@contextlib.contextmanager
def _head_at(model, target_mask):
    """While the forward runs, the model's output head (``lm_head``) takes the hidden states
    only at the positions ``target_mask`` picks, [1, N, hidden], so the logits come out as
    [1, N, vocab] in the flat per-token order. The head is found through DDP's and PEFT's
    wrappers; FSDP's hooks run around it as before."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    head = inner.get_output_embeddings()
    rows, width = target_mask.shape[0], target_mask.shape[1] + 1

    def at_targets(module, args):
        hidden = args[0]
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (rows, width):
            raise RuntimeError(f"{type(inner).__name__}'s output head got hidden states of shape {tuple(hidden.shape)}, "
                               f"not the whole batch's ({rows}, {width}, hidden)")
        return (hidden[:, :-1][target_mask].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(at_targets)
    try:
        yield
    finally:
        handle.remove()


ENTROPY_ROWS = 1024
"""Rows of log-probs the entropy takes at a time (completion_logprobs)."""

MAX_LOG_RATIO = 10.0
"""The sequence-level log-ratio is capped here (as verl's GSPO does), so that exp stays finite."""


def log_ratio(logprobs, old_logprobs, *, level: str = "token", lengths=None, mask=None):
    """Per token, the log of the PPO ratio the clip applies to.

    - ``token``: ``new - old`` of the token (PPO, GRPO).
    - ``sequence``: GSPO's (Zheng et al. 2025) length-normalised sequence ratio,
      ``log s = mean over the sequence of (new - old)``, the same on each of its tokens, in
      its per-token form ``new - sg(new) + sg(log s)``: the value is ``log s`` and the
      gradient of a token that of its own log-prob, weighed by ``s``. ``lengths``: each
      sequence's tokens, in the flat tensors' order (module docstring); ``mask``: 1 for
      the tokens the mean takes (those in the loss), or None for all; capped at
      ``MAX_LOG_RATIO``.
    """
    import torch

    if level == "token":
        return logprobs - old_logprobs
    if level != "sequence":
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}, got {level!r}")
    d = (logprobs - old_logprobs).detach()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=d.device), lengths.to(d.device))
    weight = torch.ones_like(d) if mask is None else mask.to(d)
    counted = torch.zeros(len(lengths), dtype=d.dtype, device=d.device).index_add_(0, seq, weight)
    means = torch.zeros(len(lengths), dtype=d.dtype, device=d.device).index_add_(0, seq, d * weight) / counted.clamp(min=1)
    return (logprobs - logprobs.detach() + means[seq]).clamp(max=MAX_LOG_RATIO)


def surrogate(ratio, advantages, clip_eps: float, clip_eps_high: float | None = None):
    """Per token ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)``; ``eps_high``
    defaults to ``eps`` (symmetric). A larger ``eps_high`` is DAPO's clip-higher (Yu et al.
    2025): room for unlikely tokens to gain, against entropy collapse."""
    import torch

    high = clip_eps if clip_eps_high is None else clip_eps_high
    return torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + high) * advantages)


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps: float, clip_eps_high: float | None = None):
    """:func:`surrogate` of the token ratio ``exp(new - old)``."""
    return surrogate((logprobs - old_logprobs).exp(), advantages, clip_eps, clip_eps_high)




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
              kl_estimator: str = "k3", ratio_level: str = "token", lengths=None, scale=None,
              loss_agg: str = "token_mean", mask=None) -> LossParts:
    """The loss ``-weights * surrogate + kl_coef * kl``, per token, aggregated by ``loss_agg``.

    ``weights``: per-token importance weights (:func:`is_weights`), or None.
    ``clip_eps_high``: the upper clip (default ``clip_eps``); ``kl_estimator``: k1, k2 or k3;
    ``ratio_level``: token or sequence (:func:`log_ratio`, which needs ``lengths``: each
    sequence's tokens, as ``Batch.lengths``). ``scale``: each token's factor in the sum
    (:func:`token_scale`; None: 1); ``mask``: which tokens are in the loss, for the
    sequence ratio's mean (:func:`token_mask`). The sum is divided by ``normalizer`` when given (a
    micro-batch's share of a larger batch, in tokens or sequences as ``loss_agg`` counts),
    else by this batch's tokens (``token_mean``) or sequences (the others).

    The KL term is on only with ``kl_coef > 0`` and reference log-probs. A batch without
    completion tokens gives a zero loss that is still attached to the graph, so every rank
    runs the same backward (DDP needs that).
    """
    import torch

    ratio = log_ratio(logprobs, old_logprobs, level=ratio_level, lengths=lengths, mask=mask).exp()
    per_token = -surrogate(ratio, advantages, clip_eps, clip_eps_high)
    if weights is not None:
        per_token = per_token * weights
    kl = None
    if kl_coef > 0 and ref_logprobs is not None:
        estimate = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        per_token = per_token + kl_coef * estimate
        kl = estimate.detach().mean().item() if estimate.numel() else 0.0
    if scale is not None:
        per_token = per_token * scale
    n = per_token.numel()
    with torch.no_grad():
        ratio = ratio.detach()
        clipped = (ratio < 1 - clip_eps) | (ratio > 1 + (clip_eps if clip_eps_high is None else clip_eps_high))
        clip_fraction = clipped.float().mean().item() if n else 0.0
    if normalizer is None:
        counted = n if mask is None else int(mask.sum().item())
        normalizer = max(counted if loss_agg == "token_mean" else len(lengths), 1)
    return LossParts(per_token.sum() / normalizer, kl, clip_fraction, n)
