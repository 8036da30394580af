"""The multi-turn environment contract under the name users import it by
(``from orchestrator.environments import Step``); its code is orchestrator/plugins/environments.py."""

from orchestrator.plugins.environments import Environment, OneTurn, Step, Turn

__all__ = ["Environment", "OneTurn", "Step", "Turn"]
