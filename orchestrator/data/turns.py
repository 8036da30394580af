"""Token-exact turns of a multi-turn sample: what the next turn's prompt is, as token ids.

The classic bug of multi-turn RL is to render the conversation as text again and tokenize it:
a BPE tokenizer can give other ids than the engine sampled, and the importance ratio is then
silently wrong. Here nothing sampled is tokenized again. A sample's context is the prompt's
ids, then, turn by turn, the ids the engine sampled (trained, with its log-probs) and the ids
that close the model's turn and render the environment's observation up to the next turn's
generation prompt (context only, ``loss_mask`` 0).

The observation's ids are what the chat template renders for those messages after a model's
turn. They are computed against a fixed conversation (:func:`observation_ids`), not against
the sample's own text: the part of the rendering after the model's end-of-turn token, so the
template's separators come with them. A model's turn that did not end with that token (cut
at a stop string or at ``max_tokens``) is closed with it, as context.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
"""The fixed conversation observations are rendered after."""


def render(tokenizer, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    """The ids the chat template renders ``messages`` with (and ``tools``, the OpenAI API's
    tool schemas, where the template renders them)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers


def turn_end(tokenizer) -> int:
    """The token that ends a model's turn in the chat template: the tokenizer's EOS."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end a model's turn with")
    return tokenizer.eos_token_id


def observation_ids(tokenizer, observation: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The ids the chat template renders ``observation`` with after a model's turn, its
    end-of-turn token excluded, up to and including the next turn's generation prompt (the
    conversation's ``tools`` rendered too, as they change what some templates put there).
    ValueError when the template does not render a conversation as a prefix of its continuation."""
    prefix = _probe_prefix(tokenizer, json.dumps(tools, sort_keys=True) if tools else None)
    after = render(tokenizer, _PROBE + observation, generation_prompt=True, tools=tools)
    if after[: len(prefix)] != prefix:
        raise ValueError("the chat template renders a conversation differently once messages follow it: the observation's "
                         "ids cannot be told apart")
    return after[len(prefix):]


@functools.lru_cache(maxsize=64)
def _probe_prefix(tokenizer, tools: str | None) -> list[int]:
    """The fixed conversation's ids up to its model's end-of-turn token, with ``tools`` (JSON)
    rendered: the same for every observation of a run, rendered once."""
    end = turn_end(tokenizer)
    before = render(tokenizer, _PROBE, generation_prompt=False, tools=json.loads(tools) if tools else None)
    if end not in before:
        raise ValueError("the chat template does not end the model's turn with the EOS token")
    return before[: len(before) - before[::-1].index(end)]


@dataclass
class Conversation:
    """One sample's ids, turn by turn: ``token_ids`` after the prompt, each with its
    ``loss_mask`` (1 sampled, 0 context) and ``logprobs`` (the engine's; 0.0 for context)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    """Per turn: the text sampled and its count of ids (``tokens``), why it ended
    (``finish_reason``, and ``stop``: the stop string, when one did), then the observation's
    messages and the count of context ids that closed the turn and rendered them."""

    @property
    def context(self) -> list[int]:
        """The next turn's prompt: everything so far."""
        return self.prompt_ids + self.token_ids

    def sampled(self, ids: list[int], logprobs: list[float], text: str, finish_reason: str | None = None,
                stop: str | None = None) -> None:
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        why = {"finish_reason": finish_reason} if finish_reason else {}
        self.turns.append({"text": text, "tokens": len(ids)} | why | ({"stop": stop} if stop is not None else {}))

    def observation(self, tokenizer, observation: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The context ids the environment's answer adds: the model's turn closed if it was
        not, then the observation as the template renders it."""
        end = turn_end(tokenizer)
        return ([] if self.token_ids and self.token_ids[-1] == end else [end]) + observation_ids(tokenizer, observation, tools)

    def observed(self, observation: list[dict], ids: list[int]) -> None:
        """Append the environment's answer, ``ids`` as :meth:`observation` made them."""
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.turns[-1] |= {"observation": observation, "observation_tokens": len(ids)}
