"""`orchestrator report`: reward/eval curves, a per-rank phase timeline, barrier waits and
each iteration's time breakdown as PNG charts, ``report.json`` and one static HTML page
(``index.html``)."""

from __future__ import annotations

from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR
from orchestrator.ops import report as report_mod


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Directory for the charts, report.json and index.html.  [default: LOG_PATH/report]")
def report(log_path: Path, out: Path | None) -> None:
    """Write charts and an HTML page of a run (finished or in progress); it only reads the run."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    if not log_path.is_dir():
        terminal.abort(f"--log-path {log_path} is not a directory", EXIT_BAD_INPUT)
    if out is not None:
        out = out.absolute()
        if out.exists() and not out.is_dir():
            terminal.abort(f"--out {out} exists and is not a directory", EXIT_BAD_INPUT)

    try:
        where, data = report_mod.write_report(log_path, out)
    except report_mod.NoRunData as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    except OSError as e:
        terminal.abort(f"could not write the report: {e}", EXIT_ERROR)
    rows = data["iterations"]
    evaluated = [r for r in rows if r["eval_accuracy"] is not None]
    last = f", last eval accuracy {evaluated[-1]['eval_accuracy']:.3f} (iteration {evaluated[-1]['iteration']})" if evaluated else ""
    ranks = sorted({s["rank"] for s in data["timeline"]["segments"]})
    terminal.out.print(
        f"report of {len(rows)} iteration(s), {len(ranks)} rank(s), {len(data['timeline']['attempts'])} attempt(s){last}",
        markup=False,
    )
    terminal.out.print(f"wrote {where / report_mod.INDEX_HTML}", markup=False)
    for name in (*data["charts"].values(), report_mod.REPORT_JSON):
        terminal.out.print(f"      {where / name}", markup=False)
