"""The tool demo's environment (``demo-data --tools``): a calculator the model calls as
``<calc>123*45</calc>`` and answers after, in ``\\boxed{}``. Run it with
``rl.environment=orchestrator.demo.calculator:Calculator``; it is also the example of an
environment (orchestrator/plugins/environments.py says what one is)::

    user       What is 123*45? Use <calc></calc> and put the answer in \\boxed{}.
    assistant  <calc>123*45</calc>          -> Step(observation=[tool: 5535])
    tool       5535
    assistant  \\boxed{5535}                 -> Step(reward=1.0, done=True)

A turn with a ``\\boxed{}`` answer ends the sample, graded by ``orchestrator.rewards:math`` when
the answer is a number (a boxed expression such as ``\\boxed{123*45}`` scores 0: the product
is the calculator's to work out); a turn with neither a call nor an answer ends it with reward 0.

Expressions are read with ``ast`` and evaluated by a whitelist, never ``eval``: integers,
``+ - *``, unary minus and parentheses, at most :data:`MAX_EXPRESSION` characters, so no
call can take long (no ``**``) or reach a name.
"""

from __future__ import annotations

import ast
import operator
import re

from orchestrator.plugins import rewards
from orchestrator.plugins.environments import Step

MAX_EXPRESSION = 64
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ALPHABET = re.compile(r"[0-9+\-*() ]+")
_NUMBER = re.compile(r"-?\d+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class Calculator:
    """One sample's environment: the task's question, then a calculator until an answer."""

    reward = staticmethod(rewards.math)
    """How an answer is graded, ``fn(task, completion) -> float``: the math reward."""

    def __init__(self, task: dict):
        self.task = task

    def reset(self) -> list[dict]:
        return list(self.task["prompt"])

    def step(self, completion: str) -> Step:
        if "\\boxed{" in completion:
            number = _NUMBER.fullmatch(rewards.final_answer(completion) or "")
            return Step(reward=float(self.reward(self.task, completion)) if number else 0.0, done=True)
        call = _CALL.search(completion)
        if call is None:
            return Step(reward=0.0, done=True)
        try:
            result = str(evaluate(call.group(1)))
        except ValueError as e:
            result = f"error: {e}"
        return Step(observation=[{"role": "tool", "content": result}])


def evaluate(expression: str) -> int:
    """The value of an integer expression with ``+ - *`` and parentheses; ValueError for
    anything else (names, calls, ``**``, ``/``, a number written other than in decimal)."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    if not _ALPHABET.fullmatch(expression):
        raise ValueError("only integers, + - * and parentheses")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only integers, + - * and parentheses")
