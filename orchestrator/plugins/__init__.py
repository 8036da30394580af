"""The user's seams: what a run loads by name as ``module:name`` (``loader``), the built-in
rewards and the reward-function contract (``rewards``), and the multi-turn environment
contract (``environments``: ``Step``, ``Environment``, the one-turn default).

Users name them as ``orchestrator.rewards:math`` and import ``orchestrator.environments.Step``:
those two modules are the public faces of ``rewards`` and ``environments`` here.
"""
