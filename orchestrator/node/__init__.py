"""This node: its identity, child processes (and the collector each of its processes tunes at
its start, ``collector``), ports, GPUs and their placement, and the facts
``doctor`` and a run's preflight compare between nodes (``facts``, ``checks``).
Imports nothing of the orchestrator above ``errors``.
"""
