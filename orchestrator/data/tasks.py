"""Task files: JSON lines or Parquet, with the columns the config names.

``reasoning_gym:<name>[+<name>...]`` in place of a file generates the tasks
(data/reasoning_gym_tasks.py), ``verifiers:<id>`` loads a verifiers taskset's
(data/verifiers_tasks.py). A row becomes a task dict: ``id`` (the ``data.id_key`` column as a string, or the row
number, 1 for the first row, when the file has no such column), ``prompt`` (the
``data.prompt_key`` column: a string, sent as is, or a list of chat messages
``[{"role": ..., "content": ...}]``), ``answer`` (the ``data.answer_key`` column; a number
becomes its string) and every other column of the row under its own name, for the reward
function. A dotted key reaches into a column that holds an object (a Parquet struct, a JSON
object, or a string of JSON holding one): ``reward_model.ground_truth`` in verl's files. A
column literally named with the dots wins. A bad row is a :class:`ConfigError` naming the
file, the row and the key (exit 2, raised by the preflight before anything is written).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from orchestrator.config import RunConfig
from orchestrator.data import reasoning_gym_tasks, verifiers_tasks
from orchestrator.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TaskSource:
    path: Path
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    id_key: str = "id"
    generated: tuple | None = None
    """``(spec, split, seed, train_size, test_size, args)`` of tasks that reasoning-gym generates or a
    verifiers taskset loads (``args``: ``rl.environment_args`` as JSON, the taskset's config)."""


def for_split(config: RunConfig, split: str) -> TaskSource:
    """The task file of ``split`` ("train" or "eval") and the columns the config names."""
    d = config.data
    spec = d.train_file if split == "train" else d.test_file
    if _generator(spec) is not None:  # generated rows have their own columns
        args = json.dumps(config.rl.environment_args, sort_keys=True)
        return TaskSource(config.task_file(split), generated=(spec, split, config.seed, d.train_size, d.test_size, args))
    return TaskSource(config.task_file(split), prompt_key=d.prompt_key, answer_key=d.answer_key, id_key=d.id_key)


def generated(config: RunConfig, split: str) -> bool:
    """Whether ``split``'s tasks are generated (reasoning_gym:<names>, verifiers:<id>), not read from a file."""
    return _generator(config.data.train_file if split == "train" else config.data.test_file) is not None


def _generator(spec: str):
    """The module that makes the rows of ``spec`` when it names generated tasks, else None."""
    return next((m for m in (reasoning_gym_tasks, verifiers_tasks) if m.names(spec) is not None), None)


def read(source: TaskSource) -> list[dict]:
    """Every task of ``source``, validated (ConfigError naming file, row and key). A rank
    reads its files once: the preflight's read serves the workload too while the file is
    unchanged (the tasks are shared: do not modify them)."""
    if source.generated:
        return _read(source, 0, 0)
    try:
        st = source.path.stat()
    except OSError:
        raise ConfigError(f"task file {source.path} does not exist") from None
    return _read(source, st.st_mtime_ns, st.st_size)


def needs_chat_template(task_lists, system_prompt: str) -> bool:
    """Whether any prompt goes through the model's chat template (see :func:`render`)."""
    return bool(system_prompt) or any(isinstance(t["prompt"], list) for tasks in task_lists for t in tasks)


@functools.lru_cache(maxsize=4)
def _read(source: TaskSource, _mtime_ns: int, _size: int) -> list[dict]:
    tasks, seen = [], {}
    for row_number, row in _generated_rows(source) if source.generated else _rows(source.path):
        where = f"{source.path}, row {row_number}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: not an object with named columns")
        task = {**row, "id": _task_id(row, row_number, source, where), "prompt": _prompt(row, source, where),
                "answer": _answer(row, source, where)}
        if task["id"] in seen:
            raise ConfigError(f"{where}: duplicate id {task['id']!r} in column {source.id_key!r} (first in row {seen[task['id']]})")
        seen[task["id"]] = row_number
        tasks.append(task)
    if not tasks:
        raise ConfigError(f"{source.path} holds no tasks")
    return tasks


def _generated_rows(source: TaskSource) -> Iterator[tuple[int, object]]:
    spec, split, seed, train_size, test_size, args = source.generated
    sizes = {"seed": seed, "train_size": train_size, "test_size": test_size}
    try:
        if verifiers_tasks.names(spec) is not None:
            return enumerate(verifiers_tasks.rows(spec, split, **sizes, args=json.loads(args)), 1)
        return enumerate(reasoning_gym_tasks.rows(spec, split, **sizes), 1)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _rows(path: Path) -> Iterator[tuple[int, object]]:
    if not path.is_file():
        raise ConfigError(f"task file {path} does not exist")
    if path.suffix == ".parquet":
        yield from enumerate(_parquet_rows(path), 1)
        return
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{path}, row {n}: not JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); task files are JSON lines (.jsonl) or Parquet (.parquet)") from None


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install 'orchestrator[parquet]'") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise ConfigError(f"{path}: not a readable Parquet file: {type(e).__name__}: {e}") from None


class _NotFound(Exception):
    """A key names nothing in a row; the message says where the lookup stopped."""


def _lookup(row: dict, key: str, option: str) -> object:
    """The value ``key`` names in ``row``: the column of that name, else, for a dotted key,
    the longest leading part that names a column and the rest field by field into the objects
    it holds. Raises _NotFound saying where it stopped; ``option`` is the config key it names."""
    if key in row:
        return row[key]
    parts = key.split(".")
    start = next((i for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in row), None)
    if start is None:
        also = f", nor a column {parts[0]!r} to look into" if len(parts) > 1 else ""
        raise _NotFound(f"no column {key!r}{also} ({option}); the row has {', '.join(map(repr, row))}")
    at = ".".join(parts[:start])
    value = row[at]
    for part in parts[start:]:
        obj = _object(value)
        if obj is None:
            raise _NotFound(f"{at!r} is {str(value)[:100]!r}, not an object with a field {part!r} ({option}={key!r})")
        if part not in obj:
            raise _NotFound(f"{at!r} has no field {part!r} ({option}={key!r}); it has {', '.join(map(repr, obj)) or 'none'}")
        value, at = obj[part], f"{at}.{part}"
    return value


def _object(value: object) -> dict | None:
    """``value`` as an object to look into: a dict (a Parquet struct, a JSON object), or a
    string of JSON holding one; else None."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _task_id(row: dict, row_number: int, source: TaskSource, where: str) -> str:
    try:
        value = _lookup(row, source.id_key, "data.id_key")
    except _NotFound:
        return str(row_number)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ConfigError(f"{where}: column {source.id_key!r} must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _prompt(row: dict, source: TaskSource, where: str) -> str | list[dict]:
    try:
        value = _lookup(row, source.prompt_key, "data.prompt_key")
    except _NotFound as e:
        raise ConfigError(f"{where}: {e}") from None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(f"{where}: column {source.prompt_key!r} must be a string or a list of chat messages "
                      f"[{{\"role\": ..., \"content\": ...}}], got {str(value)[:200]}")


def _is_message(m: object) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _answer(row: dict, source: TaskSource, where: str) -> str:
    try:
        value = _lookup(row, source.answer_key, "data.answer_key")
    except _NotFound as e:
        raise ConfigError(f"{where}: {e}") from None
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where}: column {source.answer_key!r} must be a string or a number, got {str(value)[:200]}")


def render(prompt: str | list[dict], tokenizer, system_prompt: str = "") -> str:
    """The text the engine continues: a string prompt as is (as the user's message when a
    ``system_prompt`` is set), chat messages through the tokenizer's chat template with the
    generation prompt added."""
    if isinstance(prompt, str) and not system_prompt:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
