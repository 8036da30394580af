"""The model's tool calls read out of its text (``rollout.tool_parser``), per model family, as
vLLM's and SGLang's parsers of the same names read them:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more: the
  format of Qwen2.5/Qwen3's and Hermes' chat templates;
- ``llama3_json``: the turn is a JSON object ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), several joined by ``;``: Llama 3.1-3.3's JSON tool calling.

A parser returns the turn's content (the text outside the calls, None when there is none) and
the calls in the OpenAI API's shape (``{"id", "type": "function", "function": {"name",
"arguments"}}``, ``arguments`` a JSON string). A call that does not parse (bad JSON, no name,
arguments that are not an object) makes no call at all: the whole text comes back as content,
as a model's malformed call should reach the agent, never a guess.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Callable

ToolCalls = list[dict]
Parsed = tuple[str | None, ToolCalls]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes(text: str) -> Parsed:
    if "<tool_call>" not in text:
        return text, []
    bodies = _HERMES.findall(text)
    if not bodies or text.count("<tool_call>") != len(bodies):  # an unclosed call: malformed
        return text, []
    calls = [_call(body, "arguments") for body in bodies]
    if any(c is None for c in calls):
        return text, []
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def llama3_json(text: str) -> Parsed:
    stripped = text.strip()
    if not stripped.startswith("{"):
        return text, []
    calls = [_call(part, "parameters", "arguments") for part in _split_objects(stripped)]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": hermes, "llama3_json": llama3_json}


def parse(name: str, text: str) -> Parsed:
    """(content, tool calls) of a model's turn, read by the parser ``name`` (``rollout.tool_parser``)."""
    return PARSERS[name](text)


def _call(body: str, *argument_keys: str) -> dict | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _split_objects(text: str) -> list[str]:
    """``text``'s JSON objects joined by ``;`` (split at the top level only); [] when something
    else stands between them."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and not (ch == '"' and not escaped)
            continue
        if ch == '"':
            in_string = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i + 1])
                start = i + 1
        elif depth == 0 and not ch.isspace() and ch != ";":
            return []
    return parts if depth == 0 and not text[start:].strip() else []
