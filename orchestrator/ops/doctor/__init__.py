"""`orchestrator doctor`: every rank publishes its facts, the master compares them.

- :mod:`orchestrator.node.facts`: this rank's facts as a plain JSON dict (``collect``; ``quick=True`` for the
  start of a run: no filesystem measurements, at most one ``nvidia-smi``).
- :mod:`orchestrator.node.checks`: pure checks, facts by rank -> problems ``{check, ranks, detail, fix}``;
  ``quick_problems`` is the subset a run does at its start (both live in ``node`` because
  the run's preflight uses them too).
- :mod:`.session`: the exchange through ``<log-path>/doctor/`` and the filesystem
  measurements (visibility of a new and of a replaced file, clock skew).
"""

from orchestrator.node.checks import Thresholds, describe, quick_problems, run_checks
from orchestrator.node.facts import collect

__all__ = ["Thresholds", "collect", "describe", "quick_problems", "run_checks"]
