"""The built-in rewards under the names users give them (``rl.reward=orchestrator.rewards:math``,
``orchestrator.rewards:exact_match``, ``orchestrator.rewards:judge``); their code is orchestrator/plugins/rewards.py."""

from orchestrator.plugins.rewards import exact_match, final_answer, judge, math, reasoning_gym

__all__ = ["exact_match", "final_answer", "judge", "math", "reasoning_gym"]
