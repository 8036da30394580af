"""Tasks of a verifiers taskset (``data.train_file=verifiers:<id>``, and ``data.test_file``):
every rank loads the same tasks, so nothing is written or shared.

The taskset's tasks (``load()``, with ``rl.environment_args`` as its config, as the agent loads
it: plugins/verifiers_envs.py) are shuffled with the run's seed; the eval split is the first
``data.test_size`` of them, the train split the next ``data.train_size``, so no task is in both.
A taskset that loads without end (a generator) is read only that far.

A row is ``id`` (the task data's ``id``, else ``<id>-<idx>``: its place in the taskset), ``prompt`` (the task's system prompt and prompt as chat
messages), ``answer`` (the task data's, where it has one), ``data_source`` (the taskset's id:
eval breaks accuracy down by it) and ``verifiers_task``, the task's data, which the agent
validates back into the taskset's task type.
"""

from __future__ import annotations

import functools
import itertools
import json
import random

from orchestrator.plugins import verifiers_envs

PREFIX = verifiers_envs.PREFIX


def names(spec: str) -> list[str] | None:
    """``[<id>]`` of ``verifiers:<id>``; None for a task file."""
    return [spec[len(PREFIX):]] if verifiers_envs.names(spec) else None


def rows(spec: str, split: str, *, seed: int, train_size: int, test_size: int, args: dict | None = None) -> list[dict]:
    """The rows of ``split`` ("train" or "eval") of ``verifiers:<id>``'s taskset."""
    tasks = _shuffled(spec, seed, json.dumps(args or {}, sort_keys=True), train_size + test_size)
    if len(tasks) <= (test_size if split == "train" else 0):
        key = "data.test_size" if split == "train" else "data.test_file"
        raise ValueError(f"{spec}: the taskset holds {len(tasks)} tasks, none left for the train split after the "
                         f"eval split's data.test_size={test_size}: lower {key}")
    chosen = tasks[:test_size] if split == "eval" else tasks[test_size:test_size + train_size]
    return [_row(spec[len(PREFIX):], task) for task in chosen]


@functools.lru_cache(maxsize=2)
def _shuffled(spec: str, seed: int, args: str, most: int) -> tuple:
    """The taskset's tasks (``args``: its config as JSON; at most ``most`` of an endless one),
    shuffled with the run's seed: loaded once for both splits."""
    from verifiers.v1.utils.loaders import load_taskset

    taskset = load_taskset(verifiers_envs.env_config(spec, json.loads(args)).taskset)
    tasks = list(itertools.islice(iter(taskset), None if taskset.bounded else most))
    random.Random(f"{seed}:verifiers").shuffle(tasks)
    return tuple(tasks)


def _row(taskset_id: str, task) -> dict:
    data = task.data
    prompt = [{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str) else \
        [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in data.prompt or []]
    if data.system_prompt:
        prompt = [{"role": "system", "content": data.system_prompt}, *prompt]
    row = {"id": data.id or f"{taskset_id}-{data.idx}", "prompt": prompt, "data_source": taskset_id,
           verifiers_envs.TASK_COLUMN: data.model_dump(mode="json", exclude_defaults=True)}
    if getattr(data, "answer", None) is not None:
        row["answer"] = str(data.answer)
    return row
