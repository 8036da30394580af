"""`orchestrator demo-data`: the demo's tasks and warm-started base model under --data-path.

    <data-path>/tasks/train.jsonl, tasks/test.jsonl     the task files (format: demo/tasks.py)
    <data-path>/model/                                   the base model, Hugging Face format
    <data-path>/demo.json                                what was made: seed, steps, accuracy

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

from orchestrator.demo import DEFAULT_ACCURACY_BAND, DEFAULT_MAX_WARM_STEPS, DEFAULT_SEED, VALIDATION_TASKS, warm_start
from orchestrator.demo import model as demo_model
from orchestrator.demo import tasks as demo_tasks
from orchestrator.protocol import fsio

log = logging.getLogger(__name__)


def manifest_path(data_path: Path) -> Path:
    return data_path / "demo.json"


def build(data_path: Path, *, seed: int = DEFAULT_SEED, band: warm_start.Band = warm_start.Band(*DEFAULT_ACCURACY_BAND),
          max_warm_steps: int = DEFAULT_MAX_WARM_STEPS, warm_steps: int | None = None) -> dict:
    """Make the demo data, or return what is there if it was made with the same settings.

    The warm start stops in ``band`` (at most ``max_warm_steps`` steps), or with
    ``warm_steps`` set, after exactly that many steps. Raises warm_start.WarmStartError
    when the band is not reached; nothing is written to ``model/`` or ``demo.json`` then.
    """
    settings = {"seed": seed, "warm_steps_fixed": warm_steps} | (
        {"accuracy_band": [band.low, band.high], "max_warm_steps": max_warm_steps} if warm_steps is None else {})
    existing = _read_manifest(data_path)
    if existing is not None and existing.get("settings") == settings:
        log.info("demo data under %s is already there (%s)", data_path, json.dumps(settings))
        return existing
    started = time.monotonic()
    splits = demo_tasks.make_tasks(seed)
    fit, validation = splits["train"][:-VALIDATION_TASKS], splits["train"][-VALIDATION_TASKS:]

    model = demo_model.create(seed)
    staging = data_path / f".model.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    demo_model.save(model, staging)  # the tokenizer files travel with the model
    _, tokenizer = demo_model.load(staging)
    try:
        trainer = warm_start.Trainer(model, tokenizer, fit, validation, seed=seed)
        if warm_steps is None:
            log.info("warm start on %d train tasks until greedy accuracy on %d validation tasks is in %s",
                     len(fit), len(validation), band)
            result = warm_start.to_band(trainer, band=band, max_steps=max_warm_steps)
        else:
            losses = trainer.train(warm_steps)
            result = warm_start.WarmStart(warm_steps, trainer.accuracy(), losses)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    test_accuracy = warm_start.greedy_accuracy(model, tokenizer, splits["test"])
    for split, tasks in splits.items():
        demo_tasks.write_tasks(data_path / "tasks" / f"{split}.jsonl", tasks)
    demo_model.save(model, staging)
    final = data_path / "model"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)

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
    }
    fsio.atomic_write_bytes(manifest_path(data_path), (json.dumps(manifest, indent=2) + "\n").encode())
    log.info("demo data ready under %s: %d warm-start steps, greedy accuracy %.3f on validation, %.3f on test",
             data_path, result.steps, result.validation_accuracy, test_accuracy)
    return manifest


def _read_manifest(data_path: Path) -> dict | None:
    try:
        manifest = json.loads(manifest_path(data_path).read_text())
    except (OSError, ValueError):
        return None
    if not (data_path / "model" / "model.safetensors").is_file():
        return None
    return manifest
