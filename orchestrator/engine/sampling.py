"""Batched sampling from a Hugging Face causal LM with its KV cache: the engine's core.

Semantics follow vLLM's defaults, because the rollout must not care which engine served it:

- logprobs are those of the raw model distribution (``log_softmax`` of the logits before
  temperature and top-p), which is what the RL loss compares against;
- the EOS token, and the token that completes a stop string, are in ``token_ids`` (with
  their logprobs) but not in the text; a stop string ends its sample and is cut from the text;
- a request with a seed draws from its own ``torch.Generator``, so the same request with the
  same seed gives the same output.

All samples of all prompts run as one batch, left-padded: prompt ``j``'s samples are rows
``j*n .. j*n+n-1``. Each prompt is prefilled once and its cache rows repeated ``n`` times;
rows that finish leave the batch so the rest decode without them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where it is first needed, not here: the server imports this module before
# it installs its signal handlers, and a SIGTERM during the slow torch import must be clean.

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
_SEED_MODULUS = 2**64  # torch generators take 64-bit seeds; vLLM accepts signed ones too


class PromptTooLong(ValueError):
    """The prompt plus ``max_tokens`` would run past the model's context length."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """One request's sampling settings (the subset of vLLM's that the rollout uses)."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus filtering: sample from the smallest set of tokens whose mass reaches this."""
    max_tokens: int = 16
    """Most tokens generated per sample, EOS included."""
    stop: tuple[str, ...] = ()
    """Strings that end a sample; cut from the returned text."""
    seed: int | None = None
    """Seed of this request's generator; None draws a fresh one."""
    logprobs: int | None = None
    """None: no top logprobs. k: the k most likely tokens at each step, besides the sampled one."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")


@dataclass(frozen=True, slots=True)
class Sample:
    """One generated continuation."""

    text: str
    token_ids: list[int]
    token_logprobs: list[float]
    """Raw-distribution logprob of each token in ``token_ids``."""
    top_logprobs: list[list[tuple[int, float]]] | None
    """Per token, the ``logprobs`` most likely (token id, logprob), best first; None when not asked."""
    finish_reason: FinishReason
    stop_reason: str | None
    """The stop string that ended the sample (None for EOS and for length)."""


@dataclass(frozen=True, slots=True)
class Generation:
    prompt_token_ids: list[list[int]]
    samples: list[list[Sample]]
    """``samples[j][i]``: sample ``i`` of prompt ``j``."""


class _Row:
    """What one batch row has produced so far."""

    __slots__ = ("token_ids", "logprobs", "top", "finish_reason", "stop_reason", "text")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | None = None
        self.text: str | None = None


class Sampler:
    """Generates from one model; not thread-safe (the server runs one request at a time)."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_model_len: int = model.config.max_position_embeddings
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        self.eos_ids: frozenset[int] = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)
        self._token_strings: dict[int, str] = {}

    def token_string(self, token_id: int) -> str:
        """How vLLM names a token in logprobs: the token decoded on its own, specials kept."""
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return s

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def generate(self, prompts: list[str], params: SamplingParams) -> Generation:
        """Raises PromptTooLong when a prompt plus ``max_tokens`` exceeds the context length."""
        import torch

        if not prompts:
            raise ValueError("no prompts")
        prompt_ids = [self.encode(p) for p in prompts]
        for j, ids in enumerate(prompt_ids):
            if len(ids) + params.max_tokens > self.max_model_len:
                raise PromptTooLong(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{len(ids) + params.max_tokens} tokens ({len(ids)} in prompt {j}, {params.max_tokens} in the "
                    f"completion). Please reduce the length of the prompt or max_tokens."
                )
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed % _SEED_MODULUS)
        with torch.inference_mode():
            rows = self._decode(prompt_ids, params, generator)
        n = params.n
        samples = [[self._finish(rows[j * n + i], params) for i in range(n)] for j in range(len(prompts))]
        return Generation(prompt_ids, samples)

    def _decode(self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator) -> list[_Row]:
        import torch

        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for j, ids in enumerate(prompt_ids):
            input_ids[j, width - len(ids) :] = torch.tensor(ids)
            mask[j, width - len(ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        cache = out.past_key_values
        n = params.n
        if n > 1:
            cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        next_pos = positions[:, -1:].repeat_interleave(n, dim=0) + 1

        rows = [_Row() for _ in range(len(prompt_ids) * n)]
        active = list(range(len(rows)))  # batch position -> row
        top_k = params.logprobs or 0
        for step in range(params.max_tokens):
            logits = logits.float()
            logprobs = torch.log_softmax(logits, dim=-1)
            tokens = self._choose(logits, params, generator)
            chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            top = logprobs.topk(top_k, dim=-1) if top_k else None
            token_list = tokens.tolist()
            keep = []
            for b, r in enumerate(active):
                row = rows[r]
                row.token_ids.append(token_list[b])
                row.logprobs.append(chosen[b])
                if top is not None:
                    row.top.append(list(zip(top.indices[b].tolist(), top.values[b].tolist())))
                if not self._ended(row, params, last_step=step == params.max_tokens - 1):
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep)
                cache.batch_select_indices(index)
                tokens, mask, next_pos = tokens[index], mask[index], next_pos[index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return rows

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        import torch

        if params.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
            # Drop a token once the more likely ones already hold top_p of the mass; the most
            # likely token always stays.
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    def _ended(self, row: _Row, params: SamplingParams, *, last_step: bool) -> bool:
        """Record why ``row`` ends after its newest token, if it does."""
        if row.token_ids[-1] in self.eos_ids:
            row.finish_reason = FinishReason.STOP
            return True
        if params.stop:
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
            # A sample ends at the first stop string to appear, so any match is new text.
            found = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
            if found:
                at, stop = min(found)
                row.text, row.finish_reason, row.stop_reason = text[:at], FinishReason.STOP, stop
                return True
        if last_step:
            row.finish_reason = FinishReason.LENGTH
            return True
        return False

    def _finish(self, row: _Row, params: SamplingParams) -> Sample:
        assert row.finish_reason is not None, "every row ends by max_tokens at the latest"
        text = row.text
        if text is None:
            ids = row.token_ids
            if ids[-1] in self.eos_ids:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if params.logprobs is None:
            top = None
        else:
            top = row.top if params.logprobs else [[] for _ in row.token_ids]
        return Sample(text, row.token_ids, row.logprobs, top, row.finish_reason, row.stop_reason)
