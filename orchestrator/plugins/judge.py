"""The LLM judge's words (``rl.reward=orchestrator.rewards:judge``): the prompt a judge model is
asked about a completion, and how its reply is read as a reward. The calls themselves go to
the judge's engines from the rollout (workloads/rl/judge.py).

The prompt is ``judge.template`` (a text file; empty: :data:`DEFAULT_TEMPLATE`) with Python's
``str.format`` fields filled in, sent as one user message through the judge model's chat
template (plain text when it has none):

- ``{question}``: the task's prompt (of chat messages, the last user message's content);
- ``{completion}``: the completion judged (the policy's text, as the reward sees it);
- ``{answer}``: the task's reference answer;
- ``{task[column]}``: any column of the task's row.

Literal braces are written doubled (``{{`` and ``}}``). The reply is read by ``judge.parse``:

- ``verdict``: the last of the words yes, no, correct, incorrect, right, wrong, true, false
  (any case) decides: 1.0 for yes, correct, right, true; 0.0 for the others;
- ``score``: the last number in it, divided by ``judge.max_score`` (within 0..max_score).

A reply with neither is the judge's failure: the sample scores 0 with the reply recorded, and
counts against ``rl.max_reward_error_fraction`` as a failing reward does.
"""

from __future__ import annotations

import re
import string

DEFAULT_TEMPLATE = (
    "Question: {question}\n"
    "Reference answer: {answer}\n"
    "Response: {completion}\n"
    "Is the response's final answer the reference answer? Reply yes or no."
)
"""A reference-guided verdict: the judge compares the response with the task's answer."""

FIELDS = ("question", "completion", "answer", "task")
"""The names a template's fields may use."""
PARSES = ("verdict", "score")

_VERDICT = re.compile(r"\b(yes|no|correct|incorrect|right|wrong|true|false)\b", re.IGNORECASE)
_PASS = {"yes", "correct", "right", "true"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Unjudged(ValueError):
    """The judge's reply holds no verdict or score that ``judge.parse`` reads."""


def check_template(template: str, where: str) -> None:
    """ValueError naming ``where`` when ``template`` is not a format string of :data:`FIELDS`."""
    try:
        names = {field.split(".")[0].split("[")[0] for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as e:
        raise ValueError(f"{where}: not a template ({e}); write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(names - set(FIELDS))
    if unknown or "" in names:
        bad = ", ".join("{}" if n == "" else "{" + n + "}" for n in (unknown or [""]))
        raise ValueError(f"{where}: {bad} is not a field of the judge's template: its fields are "
                         f"{', '.join('{' + n + '}' for n in FIELDS[:3])} and {{task[column]}} (a literal brace is written {{{{ or }}}})")
    if "completion" not in names:
        raise ValueError(f"{where}: the template never shows the judge the completion: put {{completion}} in it")


def question(prompt: str | list[dict]) -> str:
    """The task's prompt as the judge reads it: a string as is, chat messages' last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") or "" for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def render(template: str, task: dict, completion: str) -> str:
    """The user message the judge is asked: ``template`` filled in for ``task``'s ``completion``
    (KeyError for a ``{task[column]}`` the task lacks)."""
    return template.format(question=question(task.get("prompt", "")), completion=completion, answer=task.get("answer", ""), task=task)


def score(reply: str, parse: str = "verdict", max_score: float = 10.0) -> float:
    """The reward ``reply`` gives: see the module's docstring. Raises :class:`Unjudged`."""
    if parse == "verdict":
        found = _VERDICT.findall(reply)
        if not found:
            raise Unjudged(f"the judge's reply has no verdict (yes/no, correct/incorrect, right/wrong, true/false): {reply[-300:]!r}")
        return 1.0 if found[-1].lower() in _PASS else 0.0
    found = _NUMBER.findall(reply)
    if not found:
        raise Unjudged(f"the judge's reply has no score (a number): {reply[-300:]!r}")
    value = float(found[-1])
    if not 0 <= value <= max_score:
        raise Unjudged(f"the judge's score {found[-1]} is outside 0..judge.max_score={max_score:g}: {reply[-300:]!r}")
    return value / max_score
