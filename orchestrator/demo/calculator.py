"""The tool demo's environment (``demo-data --tools``): a calculator, the function ``calc``
(:data:`CALC_TOOL`, its schema in the OpenAI API's shape, which the chat template renders), that
the model calls in the hermes format of Qwen's templates and answers after, in ``\\boxed{}``.
Run it with ``rl.environment=orchestrator.demo.calculator:Calculator``; it is also the example
of an environment (orchestrator/plugins/environments.py says what one is)::

    system     Tools: calc(expression)
    user       What is 123*45? Use calc and put the answer in \\boxed{}.
    assistant  <tool_call>{"name": "calc", "arguments": {"expression": "123*45"}}</tool_call>
                                            -> Step(observation=[tool: 5535])
    tool       5535
    assistant  \\boxed{5535}                 -> Step(reward=1.0, done=True)

A turn with a ``\\boxed{}`` answer ends the sample, graded by ``orchestrator.rewards:math`` when
the answer is a number (a boxed expression such as ``\\boxed{123*45}`` scores 0: the product
is the calculator's to work out); a turn with neither a call nor an answer (a malformed call is
none) ends it with reward 0. The same demo runs as an agent through the OpenAI API
(examples/agents/calculator_agent.py), with the same schema and :func:`calc`.

Expressions are read with ``ast`` and evaluated by a whitelist, never ``eval``: integers,
``+ - *``, unary minus and parentheses, at most :data:`MAX_EXPRESSION` characters, so no
call can take long (no ``**``) or reach a name.
"""

from __future__ import annotations

import ast
import json
import operator
import re

from orchestrator.agents import tool_parsers
from orchestrator.plugins import rewards
from orchestrator.plugins.environments import Step

MAX_EXPRESSION = 64
CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "The value of an integer expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
"""The calculator's schema, as an agent passes it in ``tools`` and the environment offers it (:attr:`Calculator.tools`)."""
_ALPHABET = re.compile(r"[0-9+\-*() ]+")
_NUMBER = re.compile(r"-?\d+")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class Calculator:
    """One sample's environment: the task's question, then a calculator until an answer."""

    reward = staticmethod(rewards.math)
    """How an answer is graded, ``fn(task, completion) -> float``: the math reward."""
    tools = [CALC_TOOL]
    """What the chat template renders with the prompt (and every observation)."""

    def __init__(self, task: dict):
        self.task = task

    def reset(self) -> list[dict]:
        return list(self.task["prompt"])

    def step(self, completion: str) -> Step:
        if "\\boxed{" in completion:
            number = _NUMBER.fullmatch(rewards.final_answer(completion) or "")
            return Step(reward=float(self.reward(self.task, completion)) if number else 0.0, done=True)
        _, calls = tool_parsers.hermes(completion)
        if not calls:
            return Step(reward=0.0, done=True)
        return Step(observation=[{"role": "tool", "content": answer(c)} for c in calls])


def answer(call: dict) -> str:
    """The calculator's reply to a tool call in the OpenAI API's shape (``{"function": {"name",
    "arguments"}}``, arguments a JSON string): the value, or ``error: ...`` saying what is wrong."""
    function = call.get("function", {})
    if function.get("name") != "calc":
        return f"error: no tool named {function.get('name')!r}; there is calc"
    try:
        expression = json.loads(function.get("arguments") or "{}").get("expression")
    except (ValueError, AttributeError):
        return "error: arguments must be a JSON object"
    return calc(expression)


def calc(expression: object) -> str:
    """The value of ``expression`` as text, or ``error: ...``."""
    if not isinstance(expression, str):
        return "error: expression must be a string"
    try:
        return str(evaluate(expression))
    except ValueError as e:
        return f"error: {e}"


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
