"""A run's config against this node: what ``config.py`` cannot check from the values alone.

``RunConfig`` validates values (ranges, combinations, mapping syntax): the same on every
node. These checks look at the node itself (the files under ``--data-path``, every row of
the task files and the length of every prompt, whether the reward module and vLLM import
here), so a config that passes on one node can fail here on another. Both run before
anything is written; a failure is a ConfigError (exit 2).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from orchestrator import rewards
from orchestrator.config import RunConfig, Workload
from orchestrator.data import prompts, tasks
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
    needed = (config.model_path / "config.json", config.task_file("train"), config.task_file("eval"))
    missing = [p for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(
            f"--data-path {config.data_path} lacks {', '.join(map(str, missing))}: make the demo data with "
            f"`orchestrator demo-data --data-path {config.data_path}`, or add --rehearsal for simulated work"
        )
    task_lists = [tasks.read(tasks.for_split(config, split)) for split in ("train", "eval")]
    if tasks.needs_chat_template(task_lists, config.data.system_prompt) and not has_chat_template(config.model_path):
        why = "data.system_prompt is set" if config.data.system_prompt else "the prompts are chat messages"
        raise ConfigError(f"{why}, but the model {config.model_path} has no chat template "
                          f"(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    for split in ("train", "eval"):
        prompts.measure(config, split)  # every prompt rendered and counted against rl.max_prompt_tokens


def has_chat_template(model: Path) -> bool:
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
