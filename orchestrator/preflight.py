"""A run's config against this node: what ``config.py`` cannot check from the values alone.

``RunConfig`` validates values (ranges, combinations, mapping syntax): the same on every
node. These checks look at the node itself (the files under ``--data-path``, whether the
reward module and vLLM import here), so a config that passes on one node can fail here on
another. Both run before anything is written; a failure is a ConfigError (exit 2).
"""

from __future__ import annotations

import importlib.util

from orchestrator import rewards
from orchestrator.config import RunConfig, Workload
from orchestrator.errors import ConfigError


def check(config: RunConfig) -> None:
    """Raise ConfigError naming what this node lacks for ``config``."""
    try:
        rewards.load(config.rl.reward)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.workload is not Workload.RL:
        return
    if config.rollout.engine == "vllm" and not config.debug_mode and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm but vLLM is not installed in this Python: pip install 'orchestrator[vllm]' "
            "on a GPU node, or run scripts/setup-vllm.sh for vLLM on CPU"
        )
    needed = (config.model_path / "config.json", config.tasks_path / "train.jsonl", config.tasks_path / "test.jsonl")
    missing = [p for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(
            f"--data-path {config.data_path} lacks {', '.join(map(str, missing))}: make the demo data with "
            f"`orchestrator demo-data --data-path {config.data_path}`, or add --rehearsal for simulated work"
        )
