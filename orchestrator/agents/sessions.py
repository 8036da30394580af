"""One sample's calls through the agent endpoint, token-exact: what each call's prompt is, as
token ids, and what the sample's record holds.

A call's messages either extend what the sample has so far (every message it sent before,
then the assistant's replies as the endpoint gave them, then new messages: the common case of
an agent loop) or they do not (the agent rewrote its history: dropped, edited or summarised
messages). Extending, the sampled ids stay as the engine sampled them and only the new
messages are rendered, after the model's turn, as context (``data/turns.py``: never the
conversation rendered again and re-tokenized). Otherwise the call starts a new segment: its
messages rendered whole as a new prompt; the sample's record then holds each segment as a
sequence of its own (``segments``), trained with the sample's reward.

Messages are compared by what the model sees: role, content (text parts joined; None is ""),
a tool call's name and arguments (parsed), not ids or fields the client adds (``refusal``,
``annotations``), so an OpenAI client that sends back the message object it got matches.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field

from orchestrator.agents import tool_parsers
from orchestrator.agents.replay import Recorded
from orchestrator.data.turns import Conversation, render


def content_text(content: object) -> str:
    """A message's content as text: a string, None (""), or the OpenAI API's list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text", None))
    raise ValueError(f"a message's content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def seen_as(message: dict) -> tuple:
    """What the model sees of ``message``: the key messages are compared by."""
    calls = tuple((c.get("function", {}).get("name"), json.dumps(_arguments(c.get("function", {}).get("arguments")), sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message.get("role"), content_text(message.get("content")), calls


def template_message(message: dict) -> dict:
    """``message`` as chat templates take it: text content, and tool calls' arguments as objects
    (Qwen's and Hermes' templates write them with ``tojson``)."""
    out = {"role": message["role"], "content": content_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": c.get("id"),
                              "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


@dataclass
class Session:
    """One sample's conversation with the model through the endpoint."""

    id: str
    task: dict
    seed: str
    """Names the sample's random streams: each call's seed is drawn from it and the call's number."""
    key: str = ""
    """Names the sample across rollouts (its task and number): its tool calls' ids are drawn
    from it, so that a carried sample's calls get the ids they had (``replay.py``)."""
    tool_parser: str = "hermes"
    conversation: Conversation | None = None
    """The current segment."""
    segments: list[Conversation] = field(default_factory=list)
    """The segments before the current one (an agent that rewrote its history)."""
    seen: list[tuple] = field(default_factory=list)
    """The current segment's messages as the model saw them (:func:`seen_as`), its replies included."""
    tools: list[dict] | None = None
    calls: int = 0
    closed: bool = False
    text: str | None = None
    """With ``/v1/completions``: the current segment as text (its prompt, then what was sampled
    and added), which a next prompt that extends it starts with."""
    in_calls_s: float = 0.0
    """Seconds the sample's calls spent in the endpoint so far (waiting for and on the engine)."""
    call_began: float | None = None
    """``time.monotonic()`` when the call in progress began; None between calls."""
    script: list[Recorded] = field(default_factory=list)
    """A carried sample's calls as it made them (``replay.py``): answered from the record."""
    halted: asyncio.Future | None = None
    """Done when the endpoint ended the sample before its agent returned: the rollout stopped it
    (result None) or it made another call than its record's (result: the error)."""

    def halt(self, error: str | None = None) -> None:
        """End the sample now (its later calls are refused): stopped (``error`` None), or failed."""
        self.closed = True
        if self.halted is not None and not self.halted.done():
            self.halted.set_result(error)

    @property
    def stopped(self) -> bool:
        """Whether the rollout's stop ended the sample (it is carried)."""
        return self.halted is not None and self.halted.done() and self.halted.result() is None

    def busy_s(self, now: float) -> float:
        """Seconds the sample spent in calls, the one in progress included: not the agent's own time."""
        return self.in_calls_s + (now - self.call_began if self.call_began is not None else 0.0)

    def prompt(self, tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The call's prompt ids: the sample's ids so far and the new messages rendered after
        them when ``messages`` extend the segment, else a new segment's prompt."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a non-empty list of chat messages with a role")
        keys = [seen_as(m) for m in messages]
        extends = (self.conversation is not None and bool(self.seen) and tools == self.tools and len(keys) > len(self.seen)
                   and keys[: len(self.seen)] == self.seen)
        if extends:
            new = [template_message(m) for m in messages[len(self.seen):]]
            c = self.conversation
            c.observed(new, c.observation(tokenizer, new, tools))
        else:
            self._segment(Conversation(render(tokenizer, [template_message(m) for m in messages], generation_prompt=True,
                                              tools=tools)))
        self.seen, self.tools, self.text = keys, tools, None
        self.calls += 1
        return self.conversation.context

    def text_prompt(self, tokenizer, prompt: object) -> list[int]:
        """The prompt ids of a ``/v1/completions`` call: a text that extends the segment's text
        keeps the segment's ids and adds only the new text's (as context); token ids that
        extend its ids likewise; otherwise a new segment."""
        c = self.conversation
        if isinstance(prompt, str):
            if c is not None and self.text is not None and prompt.startswith(self.text) and len(prompt) > len(self.text):
                new = tokenizer(prompt[len(self.text):], add_special_tokens=False)["input_ids"]
                c.observed([{"role": "text", "content": prompt[len(self.text):]}], new)
            else:
                self._segment(Conversation(list(tokenizer(prompt)["input_ids"])))
            self.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if c is not None and len(prompt) > len(c.context) and prompt[: len(c.context)] == c.context:
                new = prompt[len(c.context):]
                c.observed([{"role": "ids", "content": f"{len(new)} ids"}], new)
            else:
                self._segment(Conversation(list(prompt)))
            self.text = None
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        self.seen, self.tools = [], None  # a chat call after this one starts a segment
        self.calls += 1
        return self.conversation.context

    def answered_text(self, completion) -> None:
        """The model's continuation of a ``/v1/completions`` call, recorded."""
        stop = completion.stop_string
        self.conversation.sampled(completion.token_ids, completion.token_logprobs, completion.text, completion.finish_reason, stop)
        if self.text is not None:
            self.text += completion.text + (stop or "")

    def _segment(self, conversation: Conversation) -> None:
        if self.conversation is not None:
            self.segments.append(self.conversation)
        self.conversation = conversation

    def answered(self, completion) -> tuple[dict, str]:
        """The model's reply to the call, recorded (its ids, log-probs, why it ended): the
        assistant message in the OpenAI API's shape and the call's finish reason
        (``tool_calls`` when it called tools)."""
        stop = completion.stop_string
        self.conversation.sampled(completion.token_ids, completion.token_logprobs, completion.text, completion.finish_reason, stop)
        content, calls = tool_parsers.parse(self.tool_parser, completion.text)
        calls = [{**c, "id": self._call_id(i)} for i, c in enumerate(calls)]
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        self.seen.append(seen_as(message))
        return message, "tool_calls" if calls else completion.finish_reason

    def _call_id(self, i: int) -> str:
        """The id of the reply's ``i``-th tool call: the same each time the sample makes this call."""
        return "call_" + hashlib.sha256(f"{self.key}:{self.calls}:{i}".encode()).hexdigest()[:24]

    @property
    def every_segment(self) -> list[Conversation]:
        return self.segments + ([self.conversation] if self.conversation is not None else [])
