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
    computes them runs again after a crash (a line for the iteration is never repeated).

    A master killed while writing leaves a torn last line (no newline): it is cut before the
    new line is appended, as a shard's is. A complete line that does not parse is kept and
    skipped (``report`` skips it too).
    """
    path = layout.metrics
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = b""
    complete, _, torn = data.rpartition(b"\n")
    seen = set()
    for line in complete.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            seen.add(record.get("iteration"))
    if iteration in seen:
        return
    with open(path, "ab") as f:
        if torn:
            f.truncate(len(data) - len(torn))
        f.write(json.dumps({"iteration": iteration, **metrics}, sort_keys=True).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
