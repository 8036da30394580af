"""`orchestrator recover`: what survived, and (with --apply) clear a dead run's sync state or
salvage an iteration's shards into an aggregate marked partial."""

from __future__ import annotations

import json
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.errors import EXIT_BAD_INPUT, BadInput
from orchestrator.ops import recovery


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
@click.option("--salvage", "salvage_iteration", type=int, default=None, metavar="ITERATION",
              help="Merge this iteration's surviving train shards into an aggregate marked partial.")
@click.option("--apply", is_flag=True, help="Act; without it, only show what would be done.")
@click.option("--force", is_flag=True, help="Act even though a rank's heartbeat is fresh.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def recover(log_path: Path, salvage_iteration: int | None, apply: bool, force: bool, as_json: bool) -> None:
    """Show what is durable per iteration and the last attempt's sync state; with --apply,
    move a dead master's lease aside (and salvage, with --salvage). A dry run by default."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    try:
        report = recovery.inventory(log_path)
        if apply:
            recovery.refuse_if_alive(log_path, force)
        report["clear_sync_state"] = recovery.clear_sync_state(log_path, apply=apply)
        report["applied"] = apply
        if salvage_iteration is not None:
            report["salvage"] = recovery.salvage(log_path, salvage_iteration, apply=apply)
    except BadInput as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    if as_json:
        terminal.out.print(json.dumps(report, indent=2), markup=False)
        return
    _show(report, log_path)


def _show(report: dict, log_path: Path) -> None:
    sync = report["sync"]
    lease = sync["lease"]
    if sync["lease_corrupt"]:
        terminal.out.print("lease: corrupt (not a valid record)", markup=False)
    elif lease:
        terminal.out.print(f"lease: generation {lease['generation']}, attempt {lease['attempt']}, master {lease['host']} "
                           f"pid {lease['pid']}, {'released' if lease['released'] else 'held'}", markup=False)
    progress = sync["progress"]
    if progress:
        terminal.out.print(f"last released barrier: iteration {progress['iteration']}, phase {progress['phase']}", markup=False)
    ended = (sync.get("attempt") or {}).get("ended_by")
    if ended:
        terminal.out.print(f"attempt ended by rank {ended.get('rank')} on {ended.get('host')}: {ended.get('error')}", markup=False)
    alive = report["alive"]
    terminal.out.print("alive: " + (", ".join(f"rank {a['rank']} on {a['host']}" for a in alive) if alive else "no rank"), markup=False)
    rows = []
    for it in report["iterations"]:
        for split, s in it["splits"].items():
            shards = " ".join(f"r{r['rank']}:{r['state']} {r['records']}/{r['assigned']}" for r in s["ranks"])
            agg = s["aggregate"]
            rows.append([it["iteration"], split, shards,
                         "" if agg is None else f"{agg['records']}/{s['planned']}" + (" PARTIAL" if agg["partial"] else ""),
                         it["checkpoint"] or ""])
    if rows:
        terminal.display_table(None, ["iter", "split", "shards (rank:state records/assigned)", "aggregate", "checkpoint"], rows)
    verb = "done" if report["applied"] else "would do (dry run; add --apply)"
    for action in report["clear_sync_state"]:
        terminal.out.print(f"{verb}: {action}", markup=False)
    s = report.get("salvage")
    if s:
        counts = ", ".join(f"{label} {n} ({s['state'][label]})" for label, n in s["per_rank"].items())
        what = f"wrote {s['written']}" if s["written"] else "would write (dry run; add --apply)"
        terminal.out.print(f"salvage iteration {s['iteration']}: {what}: a partial {s['split']} aggregate of {s['records']} of "
                           f"{s['planned']} planned tasks: {counts}. Train on it with rl.train_on_partial=true", markup=False)
    if not report["applied"] and not s:
        terminal.out.print(f"Re-running the same commands resumes the run; `orchestrator recover --log-path {log_path} "
                           f"--salvage N --apply` keeps a broken iteration's trajectories.", markup=False)
