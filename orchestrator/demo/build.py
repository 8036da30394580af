"""`orchestrator demo-data`: the demo's tasks and warm-started base model under --data-path.

    <data-path>/tasks/train.jsonl, tasks/test.jsonl     the task files (format: demo/tasks.py)
    <data-path>/model/                                   the base model, Hugging Face format
    <data-path>/demo.json                                what was made: seed, steps, accuracy; and
                                                         run_keys, the reward and environment a run takes

With ``chat``: the chat demo, the same tasks as chat messages answered ``\\boxed{42}``, a
Qwen2-style model and its BPE tokenizer with a chat template (docs/demo.md). With ``tools``:
the tool demo, products answered over two turns with the calculator of demo/calculator.py, the
chat demo's kind of model and tokenizer. With ``judge`` (and ``chat``): the chat demo and its judge,
a model in ``<data-path>/judge`` that answers whether a completion's final answer is the task's
(demo/judge.py), recorded under ``judge`` in demo.json.

Deterministic for a seed; nothing is downloaded. The model directory is written to a temp
name and renamed into place, so it is complete or absent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from orchestrator.data import run_keys
from orchestrator.demo import DEFAULT_SEED, VALIDATION_TASKS, chat_tokenizer, defaults, warm_start
from orchestrator.demo import judge as demo_judge
from orchestrator.demo import model as demo_model
from orchestrator.demo import tasks as demo_tasks
from orchestrator.protocol import fsio

log = logging.getLogger(__name__)


def manifest_path(data_path: Path) -> Path:
    return run_keys.path(data_path)


def run_keys_of(*, chat: bool = False, tools: bool = False) -> dict[str, str]:
    """The reward (and environment) the demo's tasks need, which a run of its folder takes
    unless its command line sets them (data/run_keys.py)."""
    if tools:
        return {"rl.reward": "orchestrator.rewards:math", "rl.environment": "orchestrator.demo.calculator:Calculator"}
    return {"rl.reward": "orchestrator.rewards:math" if chat else "orchestrator.rewards:exact_match"}


def build(data_path: Path, *, seed: int = DEFAULT_SEED, band: warm_start.Band | None = None, max_warm_steps: int | None = None,
          warm_steps: int | None = None, chat: bool = False, tools: bool = False, judge: bool = False) -> dict:
    """Make the demo data (the chat demo's with ``chat``, the tool demo's with ``tools``), or
    return what is there if it was made with the same settings. With ``judge`` (and ``chat``),
    the chat demo's judge as well (demo/judge.py), made or reused likewise.

    The warm start stops in ``band`` (at most ``max_warm_steps`` steps; None: the demo's
    defaults, demo/__init__.py), or with ``warm_steps`` set, after exactly that many steps.
    Raises warm_start.WarmStartError when the band is not reached; nothing is written to
    ``model/`` or ``demo.json`` then.
    """
    if chat and tools:
        raise ValueError("the chat demo and the tool demo are two demos: make one")
    if judge and not chat:
        raise ValueError("the judge is the chat demo's: make it with chat")
    default_band, default_steps = defaults(chat=chat, tools=tools)
    band = band or warm_start.Band(*default_band)
    max_warm_steps = default_steps if max_warm_steps is None else max_warm_steps
    settings = {"seed": seed, "warm_steps_fixed": warm_steps} | (
        {"accuracy_band": [band.low, band.high], "max_warm_steps": max_warm_steps} if warm_steps is None else {}) | (
        {"chat": True} if chat else {}) | ({"tools": True} if tools else {})  # the default demo's settings predate the others
    keys = run_keys_of(chat=chat, tools=tools)
    existing = _read_manifest(data_path)
    if existing is not None and existing.get("settings") == settings:
        log.info("demo data under %s is already there (%s)", data_path, json.dumps(settings))
        if existing.get(run_keys.FIELD) != keys:  # made before demo.json named them
            existing[run_keys.FIELD] = keys
            fsio.atomic_write_bytes(manifest_path(data_path), (json.dumps(existing, indent=2) + "\n").encode())
        return _with_judge(data_path, existing, seed) if judge else existing
    started = time.monotonic()
    splits = demo_tasks.make_tool_tasks(seed) if tools else demo_tasks.make_tasks(seed, chat=chat)
    fit, validation = splits["train"][:-VALIDATION_TASKS], splits["train"][-VALIDATION_TASKS:]

    fmt = warm_start.TOOLS if tools else warm_start.CHAT if chat else warm_start.PLAIN
    check = f"accuracy at temperature {fmt.temperature:g}" if tools else "greedy accuracy"
    if chat:  # the tokenizer learns from the train split's conversations, answers included
        made_tokenizer = chat_tokenizer.fast(chat_tokenizer.corpus(splits["train"], fmt.target))
        model = demo_model.create_chat(seed, made_tokenizer)
    elif tools:  # from the whole conversations: calls, the calculator's answers, boxed answers
        made_tokenizer = chat_tokenizer.fast(chat_tokenizer.conversations_corpus([fmt.conversation(t) for t in splits["train"]], fmt.tools),
                                             tools=True)
        model = demo_model.create_chat(seed, made_tokenizer)
    else:
        made_tokenizer, model = None, demo_model.create(seed)
    staging = data_path / f".model.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    demo_model.save(model, staging, made_tokenizer)  # the tokenizer files travel with the model
    _, tokenizer = demo_model.load(staging)
    try:
        batch_size = warm_start.TOOLS_BATCH_SIZE if tools else warm_start.CHAT_BATCH_SIZE if chat else warm_start.BATCH_SIZE
        trainer = warm_start.Trainer(model, tokenizer, fit, validation, seed=seed, fmt=fmt, batch_size=batch_size)
        if warm_steps is None:
            log.info("warm start on %d train tasks until %s on %d validation tasks is in %s",
                     len(fit), check, len(validation), band)
            result = warm_start.to_band(trainer, band=band, max_steps=max_warm_steps)
        else:
            losses = trainer.train(warm_steps)
            result = warm_start.WarmStart(warm_steps, trainer.accuracy(), losses)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    test_accuracy = fmt.accuracy(model, tokenizer, splits["test"])
    for split, tasks in splits.items():
        demo_tasks.write_tasks(data_path / "tasks" / f"{split}.jsonl", tasks)
    demo_model.save(model, staging, made_tokenizer)
    final = data_path / "model"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    shutil.rmtree(data_path / demo_judge.DIRECTORY, ignore_errors=True)  # a judge of the tasks and model that were there

    manifest = {
        "seed": seed,
        "settings": settings,
        "warm_steps": result.steps,
        "rollbacks": result.rollbacks,
        "final_loss": round(result.losses[-1], 4) if result.losses else None,
        "validation_accuracy": result.validation_accuracy,
        "validation_tasks": f"the last {len(validation)} of tasks/train.jsonl, left out of the warm start",
        "test_accuracy": test_accuracy,
        "tasks": {split: len(tasks) for split, tasks in splits.items()},
        "seconds": round(time.monotonic() - started, 1),
        run_keys.FIELD: keys,
    }
    fsio.atomic_write_bytes(manifest_path(data_path), (json.dumps(manifest, indent=2) + "\n").encode())
    log.info("demo data ready under %s: %d warm-start steps, %s %.3f on validation, %.3f on test",
             data_path, result.steps, check, result.validation_accuracy, test_accuracy)
    return _with_judge(data_path, manifest, seed, splits) if judge else manifest


def _with_judge(data_path: Path, manifest: dict, seed: int, splits: dict | None = None) -> dict:
    """``manifest`` with the chat demo's judge made (or the one there reused) and recorded under
    ``judge`` in demo.json."""
    splits = splits or demo_tasks.make_tasks(seed, chat=True)
    entry = demo_judge.build(data_path, splits, seed=seed, existing=manifest.get("judge"))
    if entry is not manifest.get("judge"):
        manifest = manifest | {"judge": entry}
        fsio.atomic_write_bytes(manifest_path(data_path), (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def _read_manifest(data_path: Path) -> dict | None:
    try:
        manifest = json.loads(manifest_path(data_path).read_text())
    except (OSError, ValueError):
        return None
    if not (data_path / "model" / "model.safetensors").is_file():
        return None
    return manifest
