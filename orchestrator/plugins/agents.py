"""Agents: the seam of ``rl.agent=module:function``, an agent written against the OpenAI API,
called once per sample as ``function(task, base_url)`` (orchestrator/agents/ runs it);
``rl.agent=verifiers:<id>`` is a verifiers environment's (plugins/verifiers_envs.py)."""

from __future__ import annotations

from orchestrator.plugins import loader as plugins
from orchestrator.plugins import verifiers_envs

_SPEC = {"key": "rl.agent", "form": "function", "example": "mypkg.agents:solve"}


def parse(spec: str) -> tuple[str, str]:
    """(module, function) of ``module:function``; ValueError when it is not of that form."""
    return plugins.parse(spec, **_SPEC)


def load(spec: str, args: dict | None = None):
    """The agent function ``module:function`` names (``verifiers:<id>``: the one that runs that
    taskset's episodes, ``args`` its config: ``rl.environment_args``); ValueError says what is wrong."""
    if verifiers_envs.names(spec):
        try:
            return verifiers_envs.agent(spec, args)
        except ValueError as e:
            raise ValueError(f"rl.agent={e}") from None
    return plugins.resolve(spec, **_SPEC, noun="function", accept=callable)
