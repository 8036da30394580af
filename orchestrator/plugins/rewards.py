"""Rewards: a plug-in seam. ``rl.reward`` names a ``module:function`` called as
``fn(task, completion) -> float``: ``task`` is the task's JSON object (every column of its row,
``answer`` included), ``completion`` the generated text. The default is :func:`exact_match`,
the verifiable reward of the demo tasks; :func:`math` grades a final math answer;
:func:`reasoning_gym` scores tasks reasoning-gym generated with the dataset's own scorer;
:func:`judge` names a judge model's verdict (plugins/judge.py). docs/rl.md describes the contract."""

from __future__ import annotations

import functools
import logging
import re
from fractions import Fraction
from typing import Callable

from orchestrator.plugins import loader as plugins

Reward = Callable[[dict, str], float]


def exact_match(task: dict, completion: str) -> float:
    """1.0 when the completion, stripped of surrounding spaces, equals the task's answer."""
    return 1.0 if completion.strip() == task["answer"].strip() else 0.0


def math(task: dict, completion: str) -> float:
    """1.0 when the completion's final answer equals the task's ``answer``.

    The final answer is the last ``\\boxed{...}``, else what follows the last ``####``
    (GSM8K), else the last number in the text; the reference answer is read the same way
    but kept whole when it has neither marker. Equality is decided by ``math-verify``
    (``pip install 'orchestrator[math]'``: ``1/2`` equals ``\\frac{1}{2}`` and ``0.5``) when
    it is installed, else by a normalized comparison (spaces, ``$``, thousands separators,
    ``\\frac``, and numbers by value). Two plain numbers (no thousands separators) are
    compared by value without math-verify unless they are within a relative 1e-4, and an
    empty answer or one with undecodable bytes or control characters scores 0 at once:
    math-verify's parse costs milliseconds, and on a CPU node the rollout grades on the
    engine's cores."""
    predicted = final_answer(completion)
    if not predicted or _garbled(predicted):
        return 0.0
    reference = final_answer(task["answer"], whole=True)
    mine, theirs = _normalized(predicted), _normalized(reference)
    if _plain(mine, predicted) and _plain(theirs, reference) and (mine == theirs or abs(mine - theirs) > _CLOSE * max(1, abs(theirs))):
        return 1.0 if mine == theirs else 0.0
    verified = _math_verify(reference, predicted)
    if verified is not None:
        return 1.0 if verified else 0.0
    return 1.0 if mine == theirs else 0.0


_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_CLOSE = 1e-4
"""Two plain numbers nearer than this (relative) go to math-verify, which rounds floats."""


def reasoning_gym(task: dict, completion: str) -> float:
    """The score reasoning-gym's own dataset gives the completion's answer (its
    ``score_answer``: 1.0 right, 0.0 wrong, and partial credit in between for some datasets),
    for tasks that ``data.train_file=reasoning_gym:<names>`` generated (their ``metadata``
    names the dataset). The answer is the completion's last ``<answer>...</answer>`` (as
    reasoning-gym's prompts ask), else its last ``\\boxed{...}``, else all of it."""
    from reasoning_gym.utils import extract_answer

    metadata = task.get("metadata") if isinstance(task.get("metadata"), dict) else {}
    name = metadata.get("source_dataset") or task.get("data_source")
    if not name:
        raise ValueError(f"task {task.get('id')!r} has no reasoning-gym dataset in metadata.source_dataset: "
                         f"orchestrator.rewards:reasoning_gym scores tasks that data.train_file=reasoning_gym:<names> generated")
    answer = extract_answer(completion)
    if answer is None:
        answer = _last_boxed(completion)
    answer = completion.strip() if answer is None else answer.strip()
    entry = {"question": task.get("question", ""), "answer": task["answer"], "metadata": metadata}
    return float(_score_answer(name)(answer=answer, entry=entry) or 0.0)


@functools.cache
def _score_answer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def _plain(value: object, text: str) -> bool:
    """A number written without thousands separators (``8,2`` may be a pair)."""
    return isinstance(value, Fraction) and "," not in text


_GARBLED = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")


def _garbled(answer: str) -> bool:
    """Undecodable bytes (U+FFFD) or control characters: no answer is written with them."""
    return _GARBLED.search(answer) is not None


def final_answer(text: str, whole: bool = False) -> str | None:
    """The last ``\\boxed{...}`` (nested braces kept), else the text after the last ``####``,
    else the last number (``whole``: else all of ``text``); None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    if whole:
        return text.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the completion was cut off inside the box


_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")


def _normalized(answer: str) -> object:
    """A comparable form: a Fraction for a number (``1,000``, ``0.50``, ``3/4``, ``\\frac{3}{4}``),
    else the string without spaces, ``$``, ``\\left``/``\\right`` and a trailing period."""
    s = _TEXT.sub(r"\1", answer)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    for junk in ("$", "\\left", "\\right", "\\!", "\\,", " "):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    number = re.fullmatch(r"\(?(-?[\d,]*\.?\d+)\)?(?:/\(?(-?\d+)\)?)?", s)
    if number is not None:
        try:
            value = Fraction(number.group(1).replace(",", ""))
            return value / Fraction(number.group(2)) if number.group(2) else value
        except (ValueError, ZeroDivisionError):
            pass
    return s


@functools.cache
def _math_verify_module():
    """math-verify, or None when it is not installed; imported once (it brings sympy: about
    0.3 s), by :func:`load` before the rollout rather than inside it."""
    try:
        import math_verify
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made without its signal timeout
    return math_verify


@functools.lru_cache(maxsize=65536)  # a group's samples often end on the same answer
def _math_verify(reference: str, predicted: str) -> bool | None:
    """math-verify's verdict, or None when it is not installed or cannot parse either side."""
    math_verify = _math_verify_module()
    if math_verify is None:
        return None
    try:
        # No signal-based timeouts: rewards run in the rollout's threads, where signal.alarm fails.
        gold = math_verify.parse(f"${reference}$", parsing_timeout=None)
        answer = math_verify.parse(f"${predicted}$", parsing_timeout=None)
        if not gold or not answer:
            return None
        return bool(math_verify.verify(gold, answer, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an expression it cannot handle: fall back to the plain comparison
        return None


_SPEC = {"key": "rl.reward", "form": "function", "example": "orchestrator.rewards:exact_match"}


def parse(spec: str, key: str = "rl.reward") -> tuple[str, str]:
    """(module, function) of ``module:function``; ValueError when it is not of that form."""
    return plugins.parse(spec, **(_SPEC | {"key": key}))


def judge(task: dict, completion: str) -> float:
    """The LLM judge's reward (``rl.reward=orchestrator.rewards:judge``, the judge section):
    asked by the rollout of the judge model's engines (workloads/rl/judge.py), never called."""
    raise RuntimeError("orchestrator.rewards:judge is the judge model's verdict, asked by a run's rollout of the judge's engines "
                       "(judge.model): it is not a function to call")


_JUDGE_SPECS = ("orchestrator.rewards:judge", "orchestrator.plugins.rewards:judge")


def is_judge(spec: str) -> bool:
    """Whether ``spec`` names the judge's reward."""
    return spec.strip() in _JUDGE_SPECS


def load(spec: str, key: str = "rl.reward") -> Reward:
    """The reward function ``module:function`` names; ValueError says what is wrong."""
    fn = plugins.resolve(spec, **(_SPEC | {"key": key}), noun="function", accept=callable)
    if fn is math:
        _math_verify_module()
    return fn
