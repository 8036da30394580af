"""Batched sampling from a Hugging Face causal LM with its KV cache: the engine's core.

Semantics follow vLLM's defaults, because the rollout must not care which engine served it:

- logprobs are those of the raw model distribution (``log_softmax`` of the logits before
  temperature and top-p), which is what the RL loss compares against;
- the EOS token, and the token that completes a stop string, are in ``token_ids`` (with
  their logprobs) but not in the text; a stop string ends its sample and is cut from the text;
- a request with a seed draws from its own ``torch.Generator``, for its own rows in their
  order, so the same request with the same seed gives the same output whichever requests
  share the batch with it (up to the last float bits of the logits, which batch shapes move);
  requests without a seed draw from one generator the sampler seeds from the OS.

Every tensor runs on the model's device (``Sampler.device``: the server's ``--device``),
generators included: a CUDA model samples with CUDA generators, so a seed gives other
samples there than on the CPU, and the same ones again on the same device.

Continuous batching, as vLLM does it: a :class:`Batch` holds the rows (sequences) of every
running request, left-padded to one width. :meth:`Sampler.prefill` runs newly arrived
requests' prompts and :meth:`Batch.join` adds their rows to the running ones;
:meth:`Sampler.step` samples one token for every row, lets the rows that ended leave (their
cache rows dropped) and runs the others one position further. Within a request, prompt
``j``'s samples are rows ``j*n .. j*n+n-1``: each prompt is prefilled once and its cache rows
repeated ``n`` times. Each request's settings (temperature, top-p, max_tokens, stop strings,
logprobs, n) apply to its own rows.

Prompt logprobs (vLLM's ``prompt_logprobs``: what a teacher says of a student's tokens) come
from the prefill that runs the prompt anyway, no second pass: the decoder's last hidden states
at every prompt position go through the model's output embeddings, a bounded number of
positions at a time, so that a long prompt never holds its full (positions, vocabulary) logits.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where it is first needed, not here: the server imports this module before
# it installs its signal handlers, and a SIGTERM during the slow torch import must be clean.

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
_SEED_MODULUS = 2**64  # torch generators take 64-bit seeds; vLLM accepts signed ones too
# Prompt positions scored at once: this many float32 logits (32 MiB). Larger chunks ran slower on
# the CPU (2**25: 2.5x, 64 prompts of 128 tokens, vocabulary 32000): each pass leaves the cache.
_SCORING_CHUNK_ELEMENTS = 2**23


class PromptRejected(ValueError):
    """A prompt the model cannot be asked to continue; the message says which and why."""


class PromptTooLong(PromptRejected):
    """The prompt plus ``max_tokens`` would run past the model's context length."""


class EmptyPrompt(PromptRejected):
    """The prompt has no token (a tokenizer without BOS, an empty string): nothing to continue."""


class UnknownToken(PromptRejected):
    """A token-id prompt holds an id past the model's vocabulary."""


class CannotScorePrompts(PromptRejected):
    """Prompt logprobs were asked of a model whose logits are not its output embeddings applied
    to its last hidden states (soft-capped or scaled after the head)."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # stopped unfinished by a pause (vLLM's word): what it had sampled so far


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
    prompt_logprobs: int | None = None
    """None: none. k: each prompt token's logprob given the tokens before it (from the second
    token on), and the k most likely tokens there."""

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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")


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
class PromptLogprobs:
    """A prompt's tokens scored by the model, from its second token on: entry ``i`` is about
    prompt token ``i + 1`` given the tokens before it, under the raw model distribution."""

    token_logprobs: list[float]
    ranks: list[int]
    """How many vocabulary entries are at least as likely as the token (1: the most likely), as vLLM counts."""
    top: list[list[tuple[int, float]]]
    """The ``prompt_logprobs`` most likely (token id, logprob), best first; empty lists for 0."""


@dataclass(frozen=True, slots=True)
class Generation:
    prompt_token_ids: list[list[int]]
    samples: list[list[Sample]]
    """``samples[j][i]``: sample ``i`` of prompt ``j``."""
    peak_batch_requests: int = 1
    """The most requests, this one included, that had rows in one decoding step with it."""
    prompt_logprobs: list[PromptLogprobs] | None = None
    """One per prompt, when asked (``SamplingParams.prompt_logprobs``) and the prompts were
    prefilled (a request aborted while queued has none)."""


class _Row:
    """What one sequence has produced so far."""

    __slots__ = ("request", "token_ids", "logprobs", "top", "finish_reason", "stop_reason", "text")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | None = None
        self.text: str | None = None


class Request:
    """One request's sequences as they run: ``rows[j*n + i]`` is sample ``i`` of prompt ``j``."""

    def __init__(self, prompt_ids: list[list[int]], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.generator = generator
        """Its own generator when it has a seed; None: the sampler's shared one."""
        self.rows = [_Row(self) for _ in range(len(prompt_ids) * params.n)]
        self.running = len(self.rows)
        """Rows not ended yet."""
        self.peak_batch_requests = 0
        """The most requests, this one included, with rows in one of its steps."""
        self.generation: Generation | None = None
        """Set by the step in which its last row ends."""
        self.prompt_logprobs: list[PromptLogprobs] | None = None
        """Set by its prefill when asked."""


class Batch:
    """The running rows of every admitted request, left-padded to one width.

    Between two steps, with B rows and W cache columns: ``mask`` (B, W) is 1 where a row has
    a token in the cache and 0 on its left padding; ``next_pos`` (B, 1) is the position of
    each row's next token; ``logits`` (B, V) that token's distribution, not sampled yet. A
    request's rows are contiguous and in their order: rows join at the end and leave without
    reordering the others.
    """

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.cache = None  # a transformers DynamicCache: keys and values (B, heads, W, head_dim)
        self.mask: torch.Tensor | None = None
        self.next_pos: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows, self.cache, self.mask, self.next_pos, self.logits = [], None, None, None, None

    @property
    def width(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def join(self, other: Batch) -> None:
        """Append ``other``'s rows; the narrower of the two is left-padded with masked columns."""
        import torch

        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos, self.logits = (
                other.rows, other.cache, other.mask, other.next_pos, other.logits)
            return
        width = max(self.width, other.width)
        with torch.inference_mode():  # the caches' tensors are inference tensors
            for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
                mine.keys = torch.cat([_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)])
                mine.values = torch.cat([_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)])
            self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(other.mask, width, -1)])
            self.next_pos = torch.cat([self.next_pos, other.next_pos])
            self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows

    def keep(self, indices: list[int]) -> None:
        """Only the rows at ``indices`` (increasing) stay. Leading columns that every remaining
        row has masked are cropped, so that padding does not grow as requests come and go."""
        import torch

        if not indices:
            self.clear()
            return
        index = torch.tensor(indices, device=self.mask.device)
        with torch.inference_mode():
            self.cache.batch_select_indices(index)
            self.mask, self.next_pos, self.logits = self.mask[index], self.next_pos[index], self.logits[index]
            used = self.mask.any(dim=0)
            first = int(used.int().argmax()) if bool(used.any()) else 0
            if first:
                for layer in _layers(self.cache):
                    layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
                self.mask = self.mask[:, first:]
        self.rows = [self.rows[b] for b in indices]


def _layers(cache) -> list:
    """The cache's layers, whose keys and values are (batch, heads, columns, head_dim)."""
    layers = cache.layers
    # Sliding-window layers keep only their last columns: padding them on the left would be wrong.
    assert not any(layer.is_sliding for layer in layers), "the sampler refuses sliding-window models"
    return layers


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros before its columns along ``dim``, up to ``width``."""
    import torch

    missing = width - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _spans(rows: list[_Row]) -> list[tuple[Request, int, int]]:
    """(request, first row, row after its last) for each request with rows in ``rows``."""
    spans = []
    start = 0
    for b in range(1, len(rows) + 1):
        if b == len(rows) or rows[b].request is not rows[start].request:
            spans.append((rows[start].request, start, b))
            start = b
    return spans


class Sampler:
    """Generates from one model. Not thread-safe: one thread owns it, its model and its
    tokenizer (the server's scheduler; HF fast tokenizers must not be used from two threads)."""

    def __init__(self, model, tokenizer) -> None:
        import torch

        kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(
                f"{type(model).__name__} has {', '.join(sorted(kinds))} layers: the embedded engine left-pads the caches "
                f"of requests to batch them, which full-attention layers only allow; serve this model with vLLM"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device: torch.device = model.device
        """Where the model's parameters are: every tensor the sampler makes goes there."""
        self.max_model_len: int = model.config.max_position_embeddings
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        self.eos_ids: frozenset[int] = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids, default=0)
        self._token_strings: dict[int, str] = {}
        self._shared = torch.Generator(device=self.device)
        self._shared.seed()
        self._plain_head: bool | None = None  # whether prompt logprobs can be computed (_check_head); None: not checked yet
        self.prompt_tokens = 0
        """Tokens of every row's prompt prefilled so far: what a prefill of each row would run."""
        self.prefill_tokens = 0
        """Tokens the prefills ran: a prompt continued by several rows (``n``, or requests with
        the same prompt) runs once."""

    def token_string(self, token_id: int) -> str:
        """How vLLM names a token in logprobs: the token decoded on its own, specials kept."""
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return s

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A text prompt tokenized; a token-id prompt as it is (checked against the vocabulary)."""
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(t >= vocab for t in prompt):
            raise UnknownToken(f"token id {max(prompt)} of the prompt is past the model's vocabulary of {vocab}")
        return list(prompt)

    def request(self, prompts: list[str | list[int]], params: SamplingParams) -> Request:
        """``prompts`` (text, or token ids) encoded, ready to join a batch. Raises PromptTooLong
        when a prompt plus ``max_tokens`` exceeds the context length, EmptyPrompt when a prompt
        has no token, UnknownToken when an id is past the vocabulary, CannotScorePrompts when
        prompt logprobs are asked of a model that cannot give them, ValueError when there is no prompt."""
        import torch

        if not prompts:
            raise ValueError("no prompts")
        if params.prompt_logprobs is not None:
            self._check_head()
        prompt_ids = [self.encode(p) for p in prompts]
        for j, ids in enumerate(prompt_ids):
            if not ids:
                raise EmptyPrompt(f"prompt {j} has no token: the model needs at least one to continue")
            if len(ids) + params.max_tokens > self.max_model_len:
                raise PromptTooLong(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{len(ids) + params.max_tokens} tokens ({len(ids)} in prompt {j}, {params.max_tokens} in the "
                    f"completion). Please reduce the length of the prompt or max_tokens."
                )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed % _SEED_MODULUS)
        return Request(prompt_ids, params, generator)

    def generate(self, prompts: list[str], params: SamplingParams) -> Generation:
        """One request on a batch of its own. Raises as :meth:`request` does."""
        request = self.request(prompts, params)
        batch = Batch()
        batch.join(self.prefill([request]))
        while request.generation is None:
            self.step(batch)
        return request.generation

    def prefill(self, requests: list[Request]) -> Batch:
        """A batch of ``requests``' rows: their distinct prompts run in one forward pass,
        left-padded, each prompt's cache rows repeated for every row that continues it (its
        request's ``n``, and the other requests with the same prompt ids: a group's samples sent
        one request each, as agents send them, are prefilled once, as vLLM's prefix cache would
        serve them). With prompt log-probs asked, every prompt runs: each is scored on its own row."""
        import torch

        scoring = any(r.params.prompt_logprobs is not None for r in requests)
        prompts = [ids for r in requests for ids in r.prompt_ids]
        samples = [r.params.n for r in requests for _ in r.prompt_ids]
        unique, row_of, of_prompt = [], {}, []  # the prompts that run; a prompt's row; each prompt's row
        for j, key in enumerate(range(len(prompts)) if scoring else map(tuple, prompts)):
            if key not in row_of:
                row_of[key] = len(unique)
                unique.append(prompts[j])
            of_prompt.append(row_of[key])
        width = max(len(ids) for ids in unique)
        input_ids = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(unique), width), dtype=torch.long)
        for j, ids in enumerate(unique):
            input_ids[j, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[j, width - len(ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)  # filled on the host: one copy, not one per prompt
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        batch = Batch()
        batch.rows = [row for r in requests for row in r.rows]
        self.prompt_tokens += sum(len(ids) * n for ids, n in zip(prompts, samples))
        self.prefill_tokens += sum(map(len, unique))
        with torch.inference_mode(), self._last_hidden_states(scoring) as hidden:
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
            )
            if scoring:
                self._score_prompts(requests, hidden.pop(), width)
            batch.cache, batch.mask = out.past_key_values, mask
            batch.next_pos, batch.logits = positions[:, -1:] + 1, out.logits[:, -1, :]
            rows = [row for row, n in zip(of_prompt, samples) for _ in range(n)]
            if len(rows) > len(unique):
                index = torch.tensor(rows, device=self.device)
                batch.cache.batch_select_indices(index)
                batch.mask, batch.next_pos, batch.logits = mask[index], batch.next_pos[index], batch.logits[index]
        return batch

    @contextlib.contextmanager
    def _last_hidden_states(self, wanted: bool):
        """A list that gets the decoder's last hidden states (rows, columns, hidden) of the
        forward pass run inside, when ``wanted``: what the head turns into logits, at every
        column, where the forward pass itself keeps only the last column's logits."""
        captured: list = []
        if not wanted:
            yield captured
            return
        handle = self.model.get_decoder().register_forward_hook(lambda module, args, output: captured.append(output[0]))
        try:
            yield captured
        finally:
            handle.remove()

    def _check_head(self) -> None:
        """Raise CannotScorePrompts unless the model's logits are its output embeddings applied
        to its decoder's last hidden states, nothing after (no soft-capping, no scaling): how
        :meth:`_score_prompts` computes them. Checked once, on a one-token forward pass."""
        import torch

        if self._plain_head is None:
            with torch.inference_mode(), self._last_hidden_states(True) as hidden:
                logits = self.model(input_ids=torch.tensor([[self.pad_id]], device=self.device)).logits[0, -1]
                again = self.model.get_output_embeddings()(hidden.pop()[0, -1])
            self._plain_head = torch.allclose(again.float(), logits.float(), rtol=1e-3, atol=1e-3)
        if not self._plain_head:
            raise CannotScorePrompts(
                f"{type(self.model).__name__} changes its logits after its output embeddings: the embedded engine cannot "
                f"give its prompt logprobs; serve this model with vLLM"
            )

    def _score_prompts(self, requests: list[Request], hidden: torch.Tensor, width: int) -> None:
        """Set the ``prompt_logprobs`` of the requests that ask for them, from their prefill's last
        hidden states ``hidden`` (prompts left-padded to ``width`` columns, in request order):
        the token at column c is scored by the logits at column c - 1, log-softmaxed in float32,
        ``_SCORING_CHUNK_ELEMENTS`` logits at a time."""
        import torch

        rows, columns, targets = [], [], []
        row = 0
        for r in requests:
            for ids in r.prompt_ids:
                if r.params.prompt_logprobs is not None:
                    rows += [row] * (len(ids) - 1)
                    columns += range(width - len(ids), width - 1)
                    targets += ids[1:]
                row += 1
        head = self.model.get_output_embeddings()
        most = min(max(r.params.prompt_logprobs for r in requests if r.params.prompt_logprobs is not None), head.out_features)
        as_index = dict(dtype=torch.long, device=self.device)  # long even when empty: prompts of one token
        states = hidden[torch.tensor(rows, **as_index), torch.tensor(columns, **as_index)]
        target = torch.tensor(targets, **as_index)[:, None]
        chunk = max(1, _SCORING_CHUNK_ELEMENTS // head.out_features)
        token_logprobs, ranks, top_ids, top_values = [], [], [], []
        for start in range(0, len(targets), chunk):
            logprobs = torch.log_softmax(head(states[start : start + chunk]).float(), dim=-1)
            chosen = logprobs.gather(1, target[start : start + chunk])
            token_logprobs += chosen[:, 0].tolist()
            ranks += (logprobs >= chosen).sum(dim=-1, dtype=torch.int32).tolist()  # int32: twice as fast as int64 on the CPU
            if most:
                top = logprobs.topk(most, dim=-1)
                top_ids += top.indices.tolist()
                top_values += top.values.tolist()
        at = 0
        for r in requests:
            k = r.params.prompt_logprobs
            if k is None:
                continue
            r.prompt_logprobs = []
            for ids in r.prompt_ids:
                end = at + len(ids) - 1
                top = [list(zip(top_ids[i][:k], top_values[i][:k])) if k else [] for i in range(at, end)]
                r.prompt_logprobs.append(PromptLogprobs(token_logprobs[at:end], ranks[at:end], top))
                at = end

    def step(self, batch: Batch) -> list[Request]:
        """Sample the next token of every row of ``batch``; rows that end leave it and the
        others run one position further. Returns the requests whose last row ended, with
        their ``generation`` (texts decoded here, on the thread that owns the tokenizer)."""
        import torch

        with torch.inference_mode():
            return self._step(batch)

    def _step(self, batch: Batch) -> list[Request]:
        import torch

        rows = batch.rows
        spans = _spans(rows)
        logits = batch.logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = self._choose(logits, spans)
        token_list = tokens.tolist()
        chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        top_k = min(max(r.params.logprobs or 0 for r, _, _ in spans), logprobs.shape[-1])
        if top_k:
            top = logprobs.topk(top_k, dim=-1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        keep: list[int] = []
        finished: list[Request] = []
        for request, start, stop in spans:
            params = request.params
            request.peak_batch_requests = max(request.peak_batch_requests, len(spans))
            k = params.logprobs or 0
            for b in range(start, stop):
                row = rows[b]
                row.token_ids.append(token_list[b])
                row.logprobs.append(chosen[b])
                if k:
                    row.top.append(list(zip(top_ids[b][:k], top_values[b][:k])))
                if self._ended(row, params):
                    request.running -= 1
                else:
                    keep.append(b)
            if not request.running:
                request.generation = self._generation(request)
                finished.append(request)
        if len(keep) < len(rows):
            batch.keep(keep)
            tokens = tokens[keep]
        if keep:
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(keep), 1))], dim=-1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=batch.mask,
                position_ids=batch.next_pos,
                past_key_values=batch.cache,
                use_cache=True,
            )
            batch.logits = out.logits[:, -1, :]
            batch.next_pos = batch.next_pos + 1
        return finished

    def _choose(self, logits: torch.Tensor, spans: list[tuple[Request, int, int]]) -> torch.Tensor:
        """Each row's next token. Greedy rows take the most likely one; the others race
        exponential noise as vLLM does (argmax of probs / q, q ~ Exp(1) per vocabulary entry,
        which samples from probs), each request drawing its rows' noise, in row order, from
        its own generator or else the shared one."""
        import torch

        tokens = logits.argmax(dim=-1)
        sampled = [(r, start, stop) for r, start, stop in spans if r.params.temperature > 0]
        if not sampled:
            return tokens
        device = logits.device
        counts = torch.tensor([stop - start for _, start, stop in sampled], device=device)
        if len(sampled) == len(spans):
            index = slice(None)  # every row: no gather
        else:
            index = torch.cat([torch.arange(start, stop, device=device) for _, start, stop in sampled])
        temperature = torch.tensor([r.params.temperature for r, _, _ in sampled], device=device).repeat_interleave(counts)
        probs = torch.softmax(logits[index] / temperature[:, None], dim=-1)
        top_p = torch.tensor([r.params.top_p for r, _, _ in sampled], device=device).repeat_interleave(counts)
        if bool((top_p < 1).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
            # Drop a token once the more likely ones already hold top_p of the mass; the most
            # likely token always stays. Rows with top_p 1 keep every token, rounding or not.
            limit = torch.where(top_p < 1, top_p, torch.inf)[:, None]
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= limit
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        noise = torch.empty_like(probs)
        at = 0
        for r, start, stop in sampled:
            noise[at : at + stop - start].exponential_(generator=self._shared if r.generator is None else r.generator)
            at += stop - start
        tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens

    def abort(self, batch: Batch, requests: list[Request]) -> None:
        """End ``requests`` now, each row as far as it got (finish reason ``abort``; a row
        that had ended keeps its own): their rows leave ``batch`` (if they are in it) and
        each gets its ``generation``."""
        gone = set(requests)
        for request in requests:
            for row in request.rows:
                if row.finish_reason is None:
                    row.finish_reason = FinishReason.ABORT
            request.running = 0
            request.generation = self._generation(request)
        if any(row.request in gone for row in batch.rows):
            batch.keep([b for b, row in enumerate(batch.rows) if row.request not in gone])

    def _ended(self, row: _Row, params: SamplingParams) -> bool:
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
        if len(row.token_ids) == params.max_tokens:
            row.finish_reason = FinishReason.LENGTH
            return True
        return False

    def _generation(self, request: Request) -> Generation:
        n = request.params.n
        samples = [
            [self._finish(request.rows[j * n + i], request.params) for i in range(n)] for j in range(len(request.prompt_ids))
        ]
        return Generation(request.prompt_ids, samples, request.peak_batch_requests, request.prompt_logprobs)

    def _finish(self, row: _Row, params: SamplingParams) -> Sample:
        assert row.finish_reason is not None, "every row ends by max_tokens at the latest, or by an abort"
        text = row.text
        if text is None:
            ids = row.token_ids
            if ids and ids[-1] in self.eos_ids:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if params.logprobs is None:
            top = None
        else:
            top = row.top if params.logprobs else [[] for _ in row.token_ids]
        return Sample(text, row.token_ids, row.logprobs, top, row.finish_reason, row.stop_reason)
