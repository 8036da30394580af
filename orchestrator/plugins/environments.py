"""Environments: the seam of multi-turn rollouts, close to skyrl-gym's ``BaseTextEnv`` and
gymnasium's ``step``, so that those adapt in a few lines. An environment is a class named as
``module:Class``; the rollout makes a new instance per sample::

    class Calculator:
        def __init__(self, task: dict): ...            # the task's whole row, as rewards get it
        def reset(self) -> list[dict]: ...             # the opening chat messages
        def step(self, completion: str) -> Step: ...   # the model's turn, as text

``Step.observation`` holds the messages to append before the model's next turn (a tool's
result, feedback); ``Step.reward`` counts when ``Step.done``. These names are a contract:
users' environments depend on them.

:class:`OneTurn` is a reward function (``rl.reward``) as an environment: the task's prompt as
the opening message, one turn, scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.plugins import loader as plugins, rewards


@dataclass(frozen=True, slots=True)
class Step:
    """What an environment answers to a turn."""

    observation: list[dict] = field(default_factory=list)
    """Chat messages (``{"role": ..., "content": ...}``) to append before the next turn."""
    reward: float = 0.0
    """The sample's reward; it counts when ``done``."""
    done: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.observation, list) or not all(_message(m) for m in self.observation):
            raise ValueError(f"Step.observation must be a list of chat messages {{'role': str, 'content': str}}, got "
                             f"{self.observation!r:.200}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"Step.reward must be a finite number, got {self.reward!r}")


def _message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


class Environment(Protocol):
    def __init__(self, task: dict) -> None: ...

    def reset(self) -> list[dict]:
        """The opening chat messages."""

    def step(self, completion: str) -> Step:
        """The answer to the model's turn."""


_SPEC = {"key": "rl.environment", "form": "Class", "example": "mypkg.envs:Calculator"}


def parse(spec: str) -> tuple[str, str]:
    """(module, class) of ``module:Class``; ValueError when it is not of that form."""
    return plugins.parse(spec, **_SPEC)


def load(spec: str) -> type:
    """The environment class ``module:Class`` names; ValueError says what is wrong."""
    cls = plugins.resolve(spec, **_SPEC, noun="class", accept=lambda x: isinstance(x, type))
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"rl.environment={spec!r}: {cls.__name__} has no {' and no '.join(missing)} method: an environment "
                         f"has reset() -> list of messages and step(completion) -> Step")
    return cls


class OneTurn:
    """A reward function as an environment: the task's prompt (its chat messages, or a string
    as the user's message), one turn, scored by ``reward(task, completion)``."""

    def __init__(self, task: dict, reward: rewards.Reward = rewards.exact_match):
        self.task, self.reward = task, reward

    def reset(self) -> list[dict]:
        prompt = self.task["prompt"]
        return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    def step(self, completion: str) -> Step:
        return Step(reward=float(self.reward(self.task, completion)), done=True)
