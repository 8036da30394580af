"""Synthetic addition tasks with an exact, verifiable answer.

Task files are JSON lines, one task per line (the format every task source follows):

    {"id": "train-000042", "prompt": "17+25=", "answer": "42"}

``id`` is unique within the file, ``prompt`` is the text the policy continues, and
``answer`` is what the default reward (``orchestrator.rewards:exact_match``) compares the
completion with. The train and test splits hold disjoint (a, b) pairs, so eval measures
generalisation rather than recall of training prompts.

The chat demo (``demo-data --chat``) asks the same questions, with the same ids and
answers, as chat messages; the model answers ``\\boxed{42}``, graded by
``orchestrator.rewards:math``:

    {"id": "train-000042", "prompt": [{"role": "user", "content": "What is 17+25? Put the answer in \\\\boxed{}."}], "answer": "42"}

The tool demo (``demo-data --tools``) asks products of a three-digit and a two-digit number,
beyond the tiny model's arithmetic, to be worked out with the calculator of
``orchestrator.demo.calculator`` (the tool ``calc``) and answered in ``\\boxed{}``; other pairs,
same format:

    {"id": "train-000042", "prompt": [{"role": "user", "content": "What is 123*45? Use calc and put the answer in \\\\boxed{}."}], "answer": "5535"}
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from orchestrator.data import tasks as data_tasks

MAX_OPERAND = 49
CHAT_QUESTION = "What is {a}+{b}? Put the answer in \\boxed{{}}."
TOOL_QUESTION = "What is {a}*{b}? Use calc and put the answer in \\boxed{{}}."
TOOL_TRAIN, TOOL_TEST = 4000, 500
"""Tasks of the tool demo: of 81,000 (a, b) pairs, a in 100..999 and b in 10..99."""


def make_tasks(seed: int, test_fraction: float = 0.2, *, chat: bool = False) -> dict[str, list[dict]]:
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    n_test = int(len(pairs) * test_fraction)
    splits = {"test": pairs[:n_test], "train": pairs[n_test:]}
    prompt = _chat_prompt if chat else _plain_prompt
    return {
        split: [{"id": f"{split}-{i:06d}", "prompt": prompt(a, b), "answer": str(a + b)} for i, (a, b) in enumerate(items)]
        for split, items in splits.items()
    }


def make_tool_tasks(seed: int) -> dict[str, list[dict]]:
    """The tool demo's tasks: ``a*b`` with a of three digits and b of two, over disjoint pairs.
    Every question is the same number of tokens: the model copies the operands from a fixed
    distance back."""
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    splits = {"test": pairs[:TOOL_TEST], "train": pairs[TOOL_TEST : TOOL_TEST + TOOL_TRAIN]}
    return {
        split: [{"id": f"{split}-{i:06d}", "prompt": [{"role": "user", "content": TOOL_QUESTION.format(a=a, b=b)}],
                 "answer": str(a * b)} for i, (a, b) in enumerate(items)]
        for split, items in splits.items()
    }


def tool_call(task: dict) -> str:
    """The tool demo's target first turn: the question's product, as a call of the calculator
    in the hermes format (``<tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>``)."""
    a, b = _PRODUCT.search(task["prompt"][0]["content"]).groups()
    return f'<tool_call>{json.dumps({"name": "calc", "arguments": {"expression": f"{a}*{b}"}})}</tool_call>'



_PRODUCT = re.compile(r"(\d+)\*(\d+)")


def _plain_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def _chat_prompt(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": CHAT_QUESTION.format(a=a, b=b)}]


def boxed(answer: str) -> str:
    """The chat demo's target completion for ``answer`` (before the end-of-turn token)."""
    return f"\\boxed{{{answer}}}"


def write_tasks(path: Path, tasks: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task, separators=(",", ":")) + "\n")


def read_tasks(path: Path) -> list[dict]:
    """Tasks of a JSON-lines file, validated like any task file (``data/tasks.py``)."""
    return data_tasks.read(data_tasks.TaskSource(path))
