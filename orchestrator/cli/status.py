"""`orchestrator status`: who is where, heartbeat ages, per-iteration results, root cause."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.errors import EXIT_BAD_INPUT, BadInput
from orchestrator.status import snapshot


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema in docs/operations.md).")
@click.option("--watch", is_flag=True, help="Refresh every 2 s until Ctrl+C.")
def status(log_path: Path, as_json: bool, watch: bool) -> None:
    """Show where every rank of the run is."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    while True:
        try:
            snap = snapshot(log_path)
        except BadInput as e:
            terminal.abort(str(e), EXIT_BAD_INPUT)
        if as_json:
            terminal.out.print_json(json.dumps(snap)) if not watch else terminal.out.print(json.dumps(snap), markup=False)
        else:
            render(snap)
        if not watch:
            return
        try:
            time.sleep(2)
        except KeyboardInterrupt:
            return
        terminal.out.clear()


def render(snap: dict) -> None:
    m = snap["master"]
    terminal.out.print(
        f"run {snap['log_path']}  attempt {snap['attempt']}  master {m['host']} pid {m['pid']}"
        f"{' (finished)' if m['released'] else ''}  rl-phase {snap['rl_phase']}  nodes {snap['num_nodes']}",
        markup=False,
    )
    rows = []
    for r in snap["ranks"]:
        p = r["progress"]
        rows.append([
            r["rank"], r["host"], r["pid"], "yes" if r["alive"] else "no", r["state"], r["iteration"], r["phase"],
            f"{p['done']}/{p['total']}" if p else "", "" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.1f}s",
        ])
    terminal.display_table(None, ["rank", "host", "pid", "alive", "state", "iter", "phase", "progress", "heartbeat"], rows)
    its = []
    for it in snap["iterations"]:
        metrics = it.get("metrics") or {}
        its.append([
            it["iteration"], ":".join(map(str, it["tasks_per_rank"] or [])), it["trajectories"],
            "yes" if it["evaluated"] else "", f"{metrics['accuracy']:.3f}" if "accuracy" in metrics else "",
            "yes" if it.get("complete") else "",
        ])
    if its:
        terminal.display_table(None, ["iter", "tasks/rank", "trajectories", "eval", "accuracy", "complete"], its)
    f = snap["failure"]
    if f:
        terminal.out.print(
            f"failure: rank {f['rank']} on {f['host']} at iteration {f['iteration']}, phase {f['phase']}: {f['error']}",
            markup=False,
        )
