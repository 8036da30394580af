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

from orchestrator.demo import DEFAULT_SEED, DEFAULT_WARM_STEPS
from orchestrator.demo import model as demo_model
from orchestrator.demo import tasks as demo_tasks
from orchestrator.demo.warm_start import greedy_accuracy, warm_start

log = logging.getLogger(__name__)



def manifest_path(data_path: Path) -> Path:
    return data_path / "demo.json"


def build(data_path: Path, *, seed: int = DEFAULT_SEED, warm_steps: int = DEFAULT_WARM_STEPS) -> dict:
    """Make the demo data, or return what is there if it was made with the same settings."""
    existing = _read_manifest(data_path)
    if existing is not None and existing["seed"] == seed and existing["warm_steps"] == warm_steps:
        log.info("demo data under %s is already there (seed %d, %d warm-start steps)", data_path, seed, warm_steps)
        return existing
    started = time.monotonic()
    splits = demo_tasks.make_tasks(seed)
    for split, tasks in splits.items():
        demo_tasks.write_tasks(data_path / "tasks" / f"{split}.jsonl", tasks)

    model = demo_model.create(seed)
    staging = data_path / f".model.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    demo_model.save(model, staging)  # the tokenizer files travel with the model
    _, tokenizer = demo_model.load(staging)
    log.info("warm start: %d supervised steps on %d train tasks", warm_steps, len(splits["train"]))
    losses = warm_start(model, tokenizer, splits["train"], steps=warm_steps, seed=seed)
    accuracy = greedy_accuracy(model, tokenizer, splits["test"])
    demo_model.save(model, staging)
    final = data_path / "model"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)

    manifest = {
        "seed": seed,
        "warm_steps": warm_steps,
        "final_loss": round(losses[-1], 4) if losses else None,
        "test_accuracy": accuracy,
        "tasks": {split: len(tasks) for split, tasks in splits.items()},
        "seconds": round(time.monotonic() - started, 1),
    }
    tmp = manifest_path(data_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path(data_path))
    log.info("demo data ready under %s: greedy test accuracy %.3f after warm start", data_path, accuracy)
    return manifest


def _read_manifest(data_path: Path) -> dict | None:
    try:
        manifest = json.loads(manifest_path(data_path).read_text())
    except (OSError, ValueError):
        return None
    if not (data_path / "model" / "model.safetensors").is_file():
        return None
    return manifest
