"""`orchestrator status`: who is where, heartbeat ages, per-iteration results, root cause."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import click
from rich.console import Group
from rich.live import Live
from rich.text import Text

from orchestrator import terminal
from orchestrator.errors import EXIT_BAD_INPUT, BadInput
from orchestrator.ops.status import snapshot
from orchestrator.ops.event_fold import EventReader
from orchestrator.protocol import child_error
from orchestrator.protocol.layout import RunLayout

WATCH_INTERVAL_S = 2.0


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (schema in docs/operations.md).")
@click.option("--watch", is_flag=True, help="Refresh every 2 s until the run ends or Ctrl+C (with --json: one object per line).")
def status(log_path: Path, as_json: bool, watch: bool) -> None:
    """Show where every rank of the run is, whom a barrier waits for, and the last failure."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    events = EventReader(RunLayout(log_path))  # kept across refreshes: each reads only what the event logs gained
    snap = _snapshot(log_path, events)
    if not watch:
        if as_json:
            terminal.out.print_json(json.dumps(snap))
        else:
            terminal.out.print(view(snap))
        return
    try:
        if as_json or not terminal.out.is_terminal:
            while True:
                if as_json:
                    terminal.out.print(json.dumps(snap), markup=False, soft_wrap=True)
                else:
                    terminal.out.print(view(snap))
                if snap["master"]["released"]:
                    return
                time.sleep(WATCH_INTERVAL_S)
                snap = _snapshot(log_path, events)
        with Live(view(snap), console=terminal.out, auto_refresh=False) as live:
            while not snap["master"]["released"]:
                time.sleep(WATCH_INTERVAL_S)
                snap = _snapshot(log_path, events)
                live.update(view(snap), refresh=True)
    except KeyboardInterrupt:
        return


def _snapshot(log_path: Path, events: EventReader) -> dict:
    try:
        return snapshot(log_path, events)
    except BadInput as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)


RANK_COLUMNS = ["rank", "host", "pid", "alive", "state", "iter", "phase", "for", "progress", "rate", "heartbeat", "note"]
RANK_COLUMNS_LEFT_OUT_FIRST = ["pid", "host", "heartbeat", "note", "for"]
"""What a narrow terminal loses first: the host and pid are in the lines under the table
(barrier, failure) and in --json; `alive` sums up the heartbeat's age; the note repeats the
barrier line. The rest (rank, alive, state, iter, phase, progress, rate) is always shown whole."""
ITERATION_COLUMNS = ["iter", "tasks/rank", "done/rank", "taken from", "trajectories", "eval", "accuracy", "complete"]
ITERATION_COLUMNS_LEFT_OUT_FIRST = ["taken from", "done/rank", "tasks/rank"]
ELSEWHERE = "--json shows them"


def _tracking(t: dict) -> str:
    said = []
    for name, b in sorted(t["backends"].items()):
        if b.get("ok"):
            said.append(f"{name} up to iteration {b['iteration']}" if b.get("iteration") else f"{name} (nothing logged yet)")
        else:
            said.append(f"{name} FAILED ({b.get('error')}): the run goes on without it")
    return f"tracking {t['run_name']}: " + "; ".join(said)


def view(snap: dict) -> Group:
    """The status screen as one rich renderable."""
    m = snap["master"]
    line = terminal.line
    parts: list = [line(f"run {snap['log_path']}  attempt {snap['attempt']}  master {m['host']} pid {m['pid']}"
                        f"{' (finished)' if m['released'] else ''}  rl-phase {snap['rl_phase']}  nodes {snap['num_nodes']}")]
    parts += [line(f"note: {n}") for n in snap.get("notes", [])]
    waiting = {w["rank"] for w in snap["waiting_for"]}
    rows = []
    for r in snap["ranks"]:
        p = r["progress"]
        rows.append([
            r["rank"], r["host"], r["pid"], "yes" if r["alive"] else "no", r["state"], r["iteration"], r["phase"],
            _duration(r["in_phase_s"]), f"{p['done']}/{p['total']}" if p else "", _rate(r["rate"]),
            "" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.1f}s",
            "out of the run" if r.get("out") else "<- barrier waits" if r["rank"] in waiting else "",
        ])
    parts.append(terminal.FittedTable(RANK_COLUMNS, rows, RANK_COLUMNS_LEFT_OUT_FIRST, elsewhere=ELSEWHERE))
    b = snap["barrier"]
    if b and b["waiting_for"]:
        who = ", ".join(f"rank {w['rank']} ({w['host']}, at {w['at']}, {w['state']})" for w in b["waiting_for"])
        parts.append(line(f"barrier {b['label']} of iteration {b['iteration']}: {len(b['arrived'])} arrived, waits for {who} "
                          f"for {_duration(b['waiting_for'][0]['waited_s'])}"))
    for o in snap.get("ranks_out", []):
        parts.append(line(f"out: rank {o['rank']} ({o['host']}) since iteration {o['iteration']}, phase {o['phase']} ({o['reason']}); "
                          f"the run goes on without it. Start the same command on that node to rejoin at the next iteration"))
    back = [e for e in snap.get("membership", []) if e["event"] == "rejoined"]
    if back:
        parts.append(line("rejoined: " + ", ".join(f"rank {e['rank']} at iteration {e['iteration']}" for e in back)))
    pipe = snap.get("pipeline")
    if pipe:
        training = (f"iteration {pipe['training']} trains in the background on rank(s) {','.join(map(str, pipe['training_ranks']))}"
                    + (f", on trajectories {_staleness(pipe['staleness'])} checkpoint(s) old"
                       if pipe["staleness"] else "") if pipe["training"] else "no training in flight")
        parts.append(line(f"pipelined (rl.max_staleness={pipe['max_staleness']}): the ranks walk iteration {pipe['iteration']}, "
                          f"phase {pipe['phase']}; {training}"))
    if snap.get("tracking"):
        parts.append(line(_tracking(snap["tracking"])))
    e = snap["eta"]
    if e:
        late = " (overdue)" if e["elapsed_s"] > e["typical_s"] else ""
        parts.append(line(f"eta: phase {e['phase']} usually takes {_duration(e['typical_s'])}, this one {_duration(e['elapsed_s'])} "
                          f"so far{late}; iteration {e['iteration']} ends in about {_duration(e['iteration_remaining_s'])}"))
    its = []
    for it in snap["iterations"]:
        metrics = it.get("metrics") or {}
        its.append([
            it["iteration"], ":".join(map(str, it["tasks_per_rank"] or [])), ":".join(map(str, it.get("tasks_done_per_rank") or [])),
            ":".join(map(str, it.get("tasks_taken_per_rank") or [])), it["trajectories"],
            "yes" if it["evaluated"] else "", f"{metrics['accuracy']:.3f}" if "accuracy" in metrics else "",
            "yes" if it.get("complete") else "",
        ])
    columns, optional = ITERATION_COLUMNS, ITERATION_COLUMNS_LEFT_OUT_FIRST
    if snap.get("pipeline"):  # rl.max_staleness >= 1: how old each iteration's trajectories were, and the IS ratios
        columns, optional = [*ITERATION_COLUMNS[:-1], "staleness", "IS ratio", ITERATION_COLUMNS[-1]], [*optional, "IS ratio"]
        for row, it in zip(its, snap["iterations"]):
            ratio = it.get("is_ratio") or {}
            row[-1:-1] = [_staleness(it.get("staleness")),
                          f"{ratio['mean']:.3f} (max {ratio['max']:.2f})" if ratio.get("mean") is not None else ""]
    if any((it.get("update") or {}).get("filtered_groups") is not None for it in snap["iterations"]):  # rl.filter_groups
        columns, optional = [*columns[:-1], "filtered", columns[-1]], [*optional, "filtered"]
        for row, it in zip(its, snap["iterations"]):
            update, drawn = it.get("update") or {}, it.get("resample") or {}
            rounds = f", {drawn['rounds']} more round(s)" if drawn.get("rounds") else ""
            row[-1:-1] = [f"{update['filtered_groups']}/{update['records']}{rounds}" if update.get("filtered_groups") is not None else ""]
    if any(it.get("partial") for it in snap["iterations"]):  # rollout.partial: groups carried in/out, token ages
        columns, optional = [*columns[:-1], "carried", columns[-1]], [*optional, "carried"]
        for row, it in zip(its, snap["iterations"]):
            p = it.get("partial") or {}
            row[-1:-1] = [f"{p['carried_in']} in, {p['carried_out']} out, age <={p['token_age_max']}"
                          + (f", {p['dropped']} dropped" if p.get("dropped") else "") if p else ""]
    if its:
        parts.append(terminal.FittedTable(columns, its, optional, elsewhere=ELSEWHERE))
    replays = [(it["iteration"], it["update"]["replayed"]) for it in snap["iterations"] if (it.get("update") or {}).get("replayed")]
    if replays:
        parts.append(line("; ".join(f"iteration {i}'s trainer replayed iterations {a}..{b} from their aggregates" for i, (a, b) in replays[-3:])
                          + " (their checkpoints hold no training state: checkpoint.state_every)"))
    timed = [it for it in snap["iterations"] if it.get("complete") and it.get("timing") and it["timing"]["phases"]]
    if timed:
        parts.append(line(time_line(timed[-1]["iteration"], timed[-1]["timing"])))
    g = snap.get("gone")
    if g:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(g["since"])) if g["since"] is not None else "unknown"
        last = "; ".join(f"rank {r['rank']} ({r['host']}) at iteration {r['iteration']}, phase {r['phase']} ({r['state']})"
                         for r in g["last"])
        parts.append(line(f"no rank alive since {since} ({_duration(g['since_s'])} ago); last seen: {last}. "
                          f"Re-run the same commands on every node to resume"))
    f = snap["failure"]
    if f:
        parts.append(line(f"failure: rank {f['rank']} on {f['host']} at iteration {f['iteration']}, phase {f['phase']}: {f['error']}"))
        child = f.get("child")
        if child:
            parts.append(Text(f"raised in the {child['program']} (pid {child.get('pid')} on {child.get('host')}); its traceback ends:\n"
                              + textwrap.indent(child_error.traceback_tail(child, 6), "    ")))
        if not any(r["alive"] for r in snap["ranks"]):
            parts.append(line(f"to recover: fix what the failure names, then re-run the same commands on every node (the run "
                              f"resumes from its last finished phase); `orchestrator recover --log-path {snap['log_path']}` "
                              f"shows what survived"))
    return Group(*parts)


TIME_LINE_PHASES = 4  # the slowest phases named; the rest are summed as "other"


def time_line(iteration: int, timing: dict) -> str:
    """One line of where an iteration's time went: its slowest phases, the parts of training
    inside the train phase, and the engines' parts (they fall in several phases)."""
    parts = timing["parts"]
    train = [f"{p.split('.', 1)[1]} {_duration(s)}" for p, s in parts.items() if p.startswith("train.") and p != "train.total"]
    engine = [f"{p.split('.', 1)[1]} {_duration(s)}" for p, s in parts.items() if p.startswith("engine.")]
    ranked = sorted(timing["phases"].items(), key=lambda kv: -kv[1])
    shown = []
    for label, seconds in ranked[:TIME_LINE_PHASES]:
        name = label.split(":", 1)[1]
        shown.append(f"{name} {_duration(seconds)}" + (f" ({', '.join(train)})" if name == "train" and train else ""))
    rest = sum(s for _, s in ranked[TIME_LINE_PHASES:])
    if rest:
        shown.append(f"other {_duration(rest)}")
    line = f"last iteration {iteration} took {_duration(timing['total_s'])}: {', '.join(shown)}"
    line += f"; engines (slowest): {', '.join(engine)}" if engine else ""
    moved = timing.get("bytes")
    if not moved:
        return line
    of_it = ", ".join(f"{what} {_size(moved[key])}" for key, what in (("written_deltas", "deltas"), ("written_state", "training state"))
                      if moved.get(key))
    return line + f"; checkpoint {_size(moved['written'])} written{f' ({of_it})' if of_it else ''}, {_size(moved['read'])} read by the engines"


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def _staleness(span: list[int] | None) -> str:
    """[fewest, most] checkpoints behind as ``1`` or ``0-1``; empty when unknown."""
    return "-".join(map(str, sorted(set(span or []))))


def _rate(tasks_per_s: float | None) -> str:
    if not tasks_per_s:
        return ""
    return f"{tasks_per_s:.0f}/s" if tasks_per_s >= 100 else f"{tasks_per_s:.1f}/s" if tasks_per_s >= 1 else f"{tasks_per_s:.2g}/s"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"
