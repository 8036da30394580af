"""The per-iteration summary ``status`` shows; only the master writes it. And the master's
closing line of a completed run, from the same records (:func:`closing`)."""

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


def closing(layout: RunLayout, *, seconds: float, resumed_at: int | None = None, simulated: bool = False) -> str:
    """What the master logs once a run has completed: its iterations, the eval curve's first and
    last values (``metrics.jsonl``, as ``status`` and the report read it), ``seconds`` (this
    start's wall time; ``resumed_at``: the iteration it started at, when not the first), and
    where the report command and the checkpoints are. ``simulated``: a rehearsal's eval, said so."""
    last = (fsio.read_record(layout.progress) or {}).get("iteration", 0)
    parts = [f"{last} iteration{'s' if last != 1 else ''} in {seconds:.0f} s"
             + (f" (this start, from iteration {resumed_at})" if resumed_at and resumed_at > 1 else "")]
    evals = read_metrics(layout)
    metric = next((k for k in ("accuracy", "mean_reward") if evals and k in evals[0]), None)
    if metric is not None:
        first, final = evals[0], evals[-1]
        curve = f"{first[metric]:.3g} at iteration {first['iteration']}" + (
            f", {final[metric]:.3g} at iteration {final['iteration']}" if final is not first else "")
        parts.append(f"{'simulated ' if simulated else ''}eval {metric} {curve}")
    checkpoint = (read(layout, last) or {}).get("checkpoint") if last else None
    if checkpoint:
        parts.append(f"its last checkpoint is {layout.root / checkpoint}")
    parts.append(f"see it with `orchestrator report --log-path {layout.root}`")
    return "run complete: " + "; ".join(parts)


def _metrics_records(lines: list[bytes]) -> list[dict]:
    """The lines of ``metrics.jsonl`` that are a record of an iteration; others are skipped."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("iteration"), int):
            records.append(record)
    return records


def _metrics_bytes(layout: RunLayout) -> bytes:
    try:
        return layout.metrics.read_bytes()
    except FileNotFoundError:
        return b""


def read_metrics(layout: RunLayout) -> list[dict]:
    """One record per evaluated iteration, sorted; a torn or unparsable line is skipped and
    an iteration's first line wins (``append_metrics`` never writes two)."""
    first: dict[int, dict] = {}
    for record in _metrics_records(_metrics_bytes(layout).splitlines()):
        first.setdefault(record["iteration"], record)
    return [first[i] for i in sorted(first)]


def append_metrics(layout: RunLayout, iteration: int, metrics: dict) -> None:
    """Add the iteration's eval metrics to ``metrics.jsonl`` once, even if the phase that
    computes them runs again after a crash (a line for the iteration is never repeated).

    A master killed while writing leaves a torn last line (no newline): it is cut before the
    new line is appended, as a shard's is. A complete line that does not parse is kept and
    skipped (``read_metrics`` skips it too).
    """
    data = _metrics_bytes(layout)
    complete, _, torn = data.rpartition(b"\n")
    if any(r["iteration"] == iteration for r in _metrics_records(complete.splitlines())):
        return
    with open(layout.metrics, "ab") as f:
        if torn:
            f.truncate(len(data) - len(torn))
        f.write(json.dumps({"iteration": iteration, **metrics}, sort_keys=True).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
