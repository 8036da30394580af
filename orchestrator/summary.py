"""The per-iteration summary ``status`` shows; only the master writes it."""

from __future__ import annotations

from orchestrator import fsio
from orchestrator.layout import RunLayout


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
