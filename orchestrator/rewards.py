"""Rewards: a plug-in seam. ``rl.reward`` names a ``module:function`` that takes the task
(its JSON object) and a completion's text and returns a float. The default is
:func:`exact_match`, the verifiable reward of the demo tasks."""

from __future__ import annotations

import importlib
from typing import Callable

Reward = Callable[[dict, str], float]


def exact_match(task: dict, completion: str) -> float:
    """1.0 when the completion, stripped of surrounding spaces, equals the task's answer."""
    return 1.0 if completion.strip() == task["answer"].strip() else 0.0


def parse(spec: str) -> tuple[str, str]:
    """(module, function) of ``module:function``; ValueError when it is not of that form."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rl.reward={spec!r} is not of the form module:function (e.g. orchestrator.rewards:exact_match)")
    return module_name, attr


def load(spec: str) -> Reward:
    """The reward function ``module:function`` names; ValueError says what is wrong."""
    module_name, attr = parse(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rl.reward={spec!r}: cannot import {module_name}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rl.reward={spec!r}: {module_name} has no function {attr}")
    return fn
