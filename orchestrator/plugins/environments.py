"""Environments: the seam of multi-turn rollouts, close to skyrl-gym's ``BaseTextEnv`` and
gymnasium's ``step``, so that those run unchanged or adapt in a few lines. An environment is a
class named as ``module:Class``; the rollout makes a new instance per sample::

    class Calculator:
        def __init__(self, task: dict, **args): ...    # the task's whole row; rl.environment_args, max_turns
        def reset(self) -> list[dict]: ...             # the opening chat messages
        def step(self, completion: Turn) -> Step: ...  # the model's turn: a str, with why it ended
        def close(self): ...                           # optional: called once when the sample ends
        tools: list[dict]                              # optional: function schemas the chat template renders

``Step.observation`` holds the messages to append before the model's next turn (a tool's
result, feedback); a sample's reward is its steps' rewards summed (``rl.step_rewards=sum``) or
its last step's (``last``). A dict in skyrl-gym's ``BaseTextEnvStepOutput`` shape is taken for
a Step (:func:`as_step`). ``tools`` (the OpenAI API's function schemas, as an agent passes
them) are rendered by the chat template with the opening messages and every observation, as
the model's tool-calling format wants (:func:`tools`). These names are a contract: users' environments depend on them.

:class:`OneTurn` is a reward function (``rl.reward``) as an environment: the task's prompt as
the opening message, one turn, scored.
"""

from __future__ import annotations

import inspect
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
    """This step's reward: the sample's is its steps' summed (``rl.step_rewards=sum``, the
    default) or its last step's (``last``)."""
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers about the episode (tool calls, a game's score): a sample records the last value
    of each name its steps gave, and eval averages each over the samples (``env/<name>``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.observation, list) or not all(_message(m) for m in self.observation):
            raise ValueError(f"Step.observation must be a list of chat messages {{'role': str, 'content': str}}, got "
                             f"{self.observation!r:.200}")
        if not finite_number(self.reward):
            raise ValueError(f"Step.reward must be a finite number, got {self.reward!r}")
        if not isinstance(self.metrics, dict) or not all(isinstance(k, str) and finite_number(v) for k, v in self.metrics.items()):
            raise ValueError(f"Step.metrics must map names to finite numbers, got {self.metrics!r:.200}")


class Turn(str):
    """The model's turn as ``step`` gets it: its text (a ``str``: the end-of-turn token and a
    stop string left out, as the OpenAI API gives a completion), with why it ended."""

    finish_reason: str
    """``"stop"`` (the end-of-turn token or a stop string) or ``"length"`` (no room left)."""
    stop: str | None
    """The ``rl.stop`` string that ended the turn (left out of the text); None otherwise."""

    def __new__(cls, text: str, finish_reason: str = "stop", stop: str | None = None) -> Turn:
        turn = super().__new__(cls, text)
        turn.finish_reason, turn.stop = finish_reason, stop
        return turn


SKYRL_STEP_KEYS = frozenset({"observations", "reward", "done", "metadata", "postprocessed_action"})
"""skyrl-gym's ``BaseTextEnvStepOutput``, a dict a ``step`` may return for a :class:`Step`."""


def as_step(value: object) -> Step:
    """A step's answer as a :class:`Step`: a Step, or a dict in skyrl-gym's shape
    (``observations``, ``reward``, ``done``, ``metadata``; ``postprocessed_action`` is not
    used: the trainer trains on the ids the model sampled). ``metadata``'s numbers become the
    step's metrics. ValueError says what is wrong."""
    if isinstance(value, Step):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"step() returned {type(value).__name__}, not an orchestrator.environments.Step (or a dict in "
                         f"skyrl-gym's BaseTextEnvStepOutput shape)")
    unknown = sorted(set(value) - SKYRL_STEP_KEYS)
    if unknown or "done" not in value:
        raise ValueError(f"step() returned a dict with keys {sorted(value)}: skyrl-gym's BaseTextEnvStepOutput has "
                         f"observations, reward, done (required) and metadata")
    metadata = value.get("metadata") or {}
    metrics = {k: float(v) for k, v in metadata.items() if isinstance(k, str) and finite_number(v)} if isinstance(metadata, dict) else {}
    reward = value.get("reward")
    return Step(observation=list(value.get("observations") or []), reward=0.0 if reward is None else reward,
                done=bool(value["done"]), metrics=metrics)


def finite_number(x: object) -> bool:
    """A finite int or float, not a bool: what rewards and metrics must be."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def tools(env: object) -> list[dict] | None:
    """The function schemas an environment offers the model (its ``tools`` attribute), which
    the chat template renders with its messages; None when it has none. ValueError when they are
    not a list of schemas."""
    offered = getattr(env, "tools", None)
    if offered is None or (isinstance(offered, (list, tuple)) and not offered):
        return None
    if not isinstance(offered, (list, tuple)) or not all(isinstance(t, dict) for t in offered):
        raise ValueError(f"{type(env).__name__}.tools must be a list of function schemas as the OpenAI API takes them "
                         f"({{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}), got {offered!r:.200}")
    return list(offered)


class Environment(Protocol):
    def __init__(self, task: dict, **args) -> None: ...

    def reset(self) -> list[dict]:
        """The opening chat messages."""

    def step(self, completion: Turn) -> Step:
        """The answer to the model's turn."""


def arguments(cls: type, task: dict, *, args: dict, max_turns: int) -> dict:
    """The keyword arguments the rollout makes ``cls`` with for ``task``: ``rl.environment_args``
    (``args``) updated by the task's own ``environment_args`` column, and ``max_turns``
    (``rl.max_turns``) when the class takes it (a parameter of that name, or ``**kwargs``) and
    neither gave it. ValueError when the class does not take them."""
    own = task.get("environment_args") or {}
    if not isinstance(own, dict):
        raise ValueError(f"task {task.get('id')!r}: its environment_args column must be a JSON object, got {own!r:.100}")
    kwargs = {**args, **own}
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): it gets what was given
        return kwargs
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    if "max_turns" not in kwargs and (takes_any or any(p.name == "max_turns" for p in parameters)):
        kwargs["max_turns"] = max_turns
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    refused = sorted(set(kwargs) - named) if not takes_any else []
    if refused:
        raise ValueError(f"{cls.__name__}() takes no argument {', '.join(refused)} (from rl.environment_args or the task's "
                         f"environment_args column): give it a parameter of that name, or **kwargs")
    return kwargs


_SPEC = {"key": "rl.environment", "form": "Class", "example": "mypkg.envs:Calculator"}


def parse(spec: str) -> tuple[str, str]:
    """(module, class) of ``module:Class``; ValueError when it is not of that form."""
    return plugins.parse(spec, **_SPEC)


def load(spec: str) -> type:
    """The environment class ``module:Class`` names (``skyrl_gym:<id>``: skyrl-gym's registered
    environment, plugins/skyrl_gym.py); ValueError says what is wrong."""
    from orchestrator.plugins import skyrl_gym

    if skyrl_gym.names(spec):
        return skyrl_gym.environment(spec)
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
