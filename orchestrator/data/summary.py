"""The per-iteration summary ``status`` shows; only the master writes it."""

from __future__ import annotations

import json
import os

from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout


def read(layout: RunLayout, iteration: int) -> dict | None:
    return fsio.read_record(layout.iteration(iteration).summary)


def update(layout: RunLayout, iteration: int, **fields) -> dict:
    body = read(layout, iteration) or {
        "iteration": iteration,
        "tasks_per_rank": None,
        "trajectories": None,
        "evaluated": False,
        "metrics": None,
        "checkpoint": None,
        "complete": False,
    }
    body.update(fields)
    fsio.write_record(layout.iteration(iteration).summary, body)
    return body


def append_metrics(layout: RunLayout, iteration: int, metrics: dict) -> None:
    """Add the iteration's eval metrics to ``metrics.jsonl`` once, even if the phase that
    computes them runs again after a crash (a line for the iteration is never repeated)."""
    path = layout.metrics
    try:
        seen = {json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()}
    except FileNotFoundError:
        seen = set()
    if iteration in seen:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"iteration": iteration, **metrics}, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
