"""`orchestrator report`: what a run did, as charts, one JSON file and one static HTML page.

Read-only over the run's files (it never writes under ``--log-path`` except into its own
output directory, ``<L>/report/`` by default), so it can run at any time, during a run or
after it, on any node that mounts the log path.

This module composes the report: :func:`collect` gathers plain dicts and lists (this is
``report.json``) from the run's records (:mod:`iteration_rows`) and from the event logs as
:mod:`event_fold` folds them, read once for the timeline and barrier waits (:mod:`timeline`)
and each iteration's time (:mod:`timing`); :mod:`charts` draws and :mod:`report_html` writes
only what ``collect`` returned. :func:`write_report` writes every file atomically (temp + rename) and
returns the collected data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from orchestrator.ops.charts import barrier_wait_png, breakdown_png, curves_png, timeline_png
from orchestrator.ops.event_fold import EventReader, RankLog
from orchestrator.ops.iteration_rows import eval_curve, iteration_rows, train_rewards
from orchestrator.ops.report_html import INDEX_HTML, REPORT_JSON, index_html
from orchestrator.ops.timeline import barrier_waits, timeline
from orchestrator.ops.timing import iteration_timing
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout

CURVES_PNG = "curves.png"
TIMELINE_PNG = "timeline.png"
BARRIER_WAIT_PNG = "barrier_wait.png"
BREAKDOWN_PNG = "breakdown.png"


class NoRunData(Exception):
    """The log path holds nothing a report could show."""


def event_logs(layout: RunLayout) -> list[RankLog]:
    """Every non-empty event log of every attempt, each read once and folded whole (the
    timeline needs every rank's every line), oldest attempt first."""
    return [log for log in EventReader(layout, timeline=True).read() if log.events]


def collect(log_path: Path) -> dict:
    """Everything the report shows, as plain data (this is ``report.json``). Raises
    :class:`NoRunData` when the log path holds no iteration, metrics or events."""
    layout = RunLayout(log_path)
    evals = eval_curve(layout)
    trains = train_rewards(layout)
    logs = event_logs(layout)
    tl = timeline(logs)
    rows = iteration_rows(layout, evals, trains, tl["segments"], iteration_timing(logs))
    if not rows and not tl["segments"]:
        raise NoRunData(f"{log_path} holds no run data (no iterations, metrics.jsonl or event logs)")
    return {
        "log_path": str(log_path),
        "generated_at": time.time(),
        "iterations": rows,
        "eval": evals,
        "train": trains,
        "timeline": tl,
        "barrier_wait": barrier_waits(tl["segments"]),
        "charts": {"curves": CURVES_PNG, "timeline": TIMELINE_PNG, "barrier_wait": BARRIER_WAIT_PNG, "breakdown": BREAKDOWN_PNG},
    }


def write_report(log_path: Path, out: Path | None = None) -> tuple[Path, dict]:
    """Collect the run's data and write the charts, ``report.json`` and ``index.html`` into
    ``out`` (default ``<log_path>/report``), each atomically. Returns (out, data)."""
    out = out if out is not None else RunLayout(log_path).report
    data = collect(log_path)
    files = {
        CURVES_PNG: curves_png(data),
        TIMELINE_PNG: timeline_png(data),
        BARRIER_WAIT_PNG: barrier_wait_png(data),
        BREAKDOWN_PNG: breakdown_png(data),
        REPORT_JSON: (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(),
    }
    for name, content in files.items():
        fsio.atomic_write_bytes(out / name, content)
    # the page last: when it is there, what it references is too
    fsio.atomic_write_bytes(out / INDEX_HTML, index_html(data).encode())
    return out, data
