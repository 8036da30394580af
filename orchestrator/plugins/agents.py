"""Agents: the seam of ``rl.agent=module:function``, an agent written against the OpenAI API,
called once per sample as ``function(task, base_url)`` (orchestrator/agents/ runs it)."""

from __future__ import annotations

from orchestrator.plugins import loader as plugins

_SPEC = {"key": "rl.agent", "form": "function", "example": "mypkg.agents:solve"}


def parse(spec: str) -> tuple[str, str]:
    """(module, function) of ``module:function``; ValueError when it is not of that form."""
    return plugins.parse(spec, **_SPEC)


def load(spec: str):
    """The agent function ``module:function`` names; ValueError says what is wrong."""
    return plugins.resolve(spec, **_SPEC, noun="function", accept=callable)
