"""`orchestrator report`: what a run did, as charts, one JSON file and one static HTML page.

Read-only over the run's files (it never writes under ``--log-path`` except into its own
output directory, ``<L>/report/`` by default), so it can run at any time, during a run or
after it, on any node that mounts the log path.

The data functions (``eval_curve``, ``train_rewards``, ``iteration_rows``, ``timeline``,
``barrier_waits``, ``iteration_timing``, ``collect``) return plain dicts and lists; the plotting
and HTML functions only draw what ``collect`` returned. ``write_report`` writes every file
atomically (temp + rename) and returns the collected data, which is also ``report.json``.

Timeline segments, one per rank and stretch of time, of three kinds:

- ``work``: from the rank's ``phase`` event (it enters the phase) to its ``arrive`` event
  (it arrives at the barrier) or, for a phase without a barrier (``rollout``,
  ``prepare``), to its next ``phase`` event;
- ``wait``: the rank sits at the barrier. Workers: ``arrive`` to ``released``. Master:
  ``arrive`` to ``all_arrived`` (the last rank's arrival);
- ``decide``: master only, ``all_arrived`` to ``released`` (the phase's decision, then the
  release and progress records).

Durations come from each event's monotonic clock (``mono``) when both ends have it and it
did not go backwards, else from the wall clock ``t``. Positions on the timeline are wall
times (``t``) relative to the run's first event: ranks on different hosts are placed by
their own clocks, so a skew between hosts shifts their rows (durations are unaffected).
"""

from __future__ import annotations

import html
import io
import json
import math
import time
from collections.abc import Iterable
from pathlib import Path

from orchestrator.data import shards, summary
from orchestrator.ops import timing
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.api import Event
from orchestrator.protocol.events import read_events
from orchestrator.protocol.layout import RunLayout

CURVES_PNG = "curves.png"
TIMELINE_PNG = "timeline.png"
BARRIER_WAIT_PNG = "barrier_wait.png"
BREAKDOWN_PNG = "breakdown.png"
REPORT_JSON = "report.json"
INDEX_HTML = "index.html"

# The eval metrics drawn on the curves chart (when the run recorded them): key, name, style.
# Accuracy and mean reward coincide under an exact-match reward: the dashed line stays visible.
EVAL_SERIES = (
    ("accuracy", "eval accuracy", {"color": "tab:blue", "marker": "o", "linewidth": 2.5}),
    ("pass_at_k", "eval pass@k", {"color": "tab:orange", "marker": "s"}),
    ("mean_reward", "eval mean reward", {"color": "black", "marker": "x", "linestyle": "--", "linewidth": 1}),
)

# One colour per phase, the long phases (rollout, eval, train, engine restart) the strongest;
# grey is left to the legend of the barrier waits.
PHASE_COLOURS = (
    "#e377c2", "#1f77b4", "#aec7e8", "#17becf", "#9edae5", "#c5b0d5", "#9467bd",
    "#ff9896", "#dbdb8d", "#bcbd22", "#d62728", "#8c564b", "#ff7f0e", "#f7b6d2",
)

DPI = 80


class NoRunData(Exception):
    """The log path holds nothing a report could show."""


# -- data ------------------------------------------------------------------------------------


def _iteration_numbers(layout: RunLayout) -> list[int]:
    fsio.refresh_dir(layout.iterations)  # NFS: see iterations created since this client last looked
    try:
        names = [p.name for p in layout.iterations.iterdir() if p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit())


def eval_curve(layout: RunLayout) -> list[dict]:
    """The lines of ``metrics.jsonl`` (one per evaluated iteration), sorted by iteration."""
    return summary.read_metrics(layout)


def _record_rewards(record: dict) -> list[float]:
    """The rewards of one trajectory record: an RL record's samples, or a rehearsal record's
    single ``reward``."""
    samples = record.get("samples")
    if isinstance(samples, list):
        return [float(s["reward"]) for s in samples if isinstance(s, dict) and _is_number(s.get("reward"))]
    if _is_number(record.get("reward")):
        return [float(record["reward"])]
    return []


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def train_reward(aggregate: Path) -> dict | None:
    """Mean reward over every sample of a sealed train aggregate, read as a stream; None
    when the aggregate is not sealed (absent, or still being written)."""
    if shards.sealed(aggregate) is None:
        return None
    records, n, total = 0, 0, 0.0
    for _, _, record in shards.iter_valid_lines(aggregate):
        records += 1
        for r in _record_rewards(record):
            n += 1
            total += r
    return {"mean_reward": total / n if n else None, "records": records, "samples": n}


def train_rewards(layout: RunLayout) -> list[dict]:
    """``{iteration, mean_reward, records, samples}`` for each iteration with a sealed train
    aggregate, sorted by iteration."""
    out = []
    for i in _iteration_numbers(layout):
        r = train_reward(layout.iteration(i).aggregate("train"))
        if r is not None:
            out.append({"iteration": i, **r})
    return out


def _seconds(a: dict, b: dict) -> float:
    ma, mb = a.get("mono"), b.get("mono")
    if _is_number(ma) and _is_number(mb) and mb >= ma:
        return mb - ma
    return max(0.0, b["t"] - a["t"])


def rank_segments(events: list[dict]) -> list[dict]:
    """One rank's event log of one attempt, as segments (see the module docstring) with
    absolute wall times: ``{kind, iteration, phase, t_start, t_end, seconds, complete}``.

    ``complete`` is False for a segment the log leaves open (the rank ended, failed or is
    still in it): it ends at the rank's ``end`` event, or at its last event.
    """
    segments: list[dict] = []
    open_seg: dict | None = None
    open_ev: dict | None = None

    def close(ev: dict, complete: bool) -> None:
        nonlocal open_seg, open_ev
        if open_seg is not None:
            open_seg.update(t_end=ev["t"], seconds=_seconds(open_ev, ev), complete=complete)
            segments.append(open_seg)
        open_seg = open_ev = None

    def start(kind: str, ev: dict, iteration, phase) -> None:
        nonlocal open_seg, open_ev
        open_seg = {"kind": kind, "iteration": iteration, "phase": phase, "t_start": ev["t"]}
        open_ev = ev

    for ev in events:
        if not isinstance(ev, dict) or not _is_number(ev.get("t")):
            continue
        kind, it, ph = ev.get("event"), ev.get("iteration"), ev.get("phase")
        same = open_seg is not None and open_seg["iteration"] == it and open_seg["phase"] == ph
        if kind == Event.PHASE:
            # the previous phase had no barrier (or the log lost its arrival): its work ends here
            close(ev, complete=open_seg is not None and open_seg["kind"] == "work")
            start("work", ev, it, ph)
        elif kind == Event.ARRIVE:
            close(ev, complete=same and open_seg["kind"] == "work")
            start("wait", ev, it, ph)
        elif kind == Event.ALL_ARRIVED:
            close(ev, complete=same and open_seg["kind"] == "wait")
            start("decide", ev, it, ph)
        elif kind == Event.RELEASED:
            close(ev, complete=same and open_seg["kind"] in ("wait", "decide"))
        elif kind == Event.END:
            close(ev, complete=False)
    if open_seg is not None and open_ev is not None:
        last = next(ev for ev in reversed(events) if isinstance(ev, dict) and _is_number(ev.get("t")))
        close(last, complete=False)
    return segments


def event_logs(layout: RunLayout) -> list[tuple[str, dict[int, list[dict]]]]:
    """``(attempt, {rank: events})`` for every attempt with a non-empty event log, oldest first."""
    per_attempt = []
    for a in timing.attempt_ids(layout):
        logs = {r: read_events(layout.attempt(a).events(r)) for r in timing.event_ranks(layout, a)}
        logs = {r: evs for r, evs in logs.items() if evs}
        if logs:
            per_attempt.append((a, logs))
    return per_attempt


def timeline(per_attempt: list[tuple[str, dict[int, list[dict]]]]) -> dict:
    """Every rank's segments over every attempt (``per_attempt``: :func:`event_logs`), with
    times relative to the run's first event.

    Returns ``{origin_t, attempts: [{attempt, start_s, end_s, ranks}], segments: [...],
    steals: [...], membership: [...]}``; each segment is ``{attempt, rank, kind, iteration,
    phase, label, start_s, end_s, seconds, complete}``, ordered by attempt, rank and time;
    each steal is ``{attempt, rank, victim, split, chunk, tasks, iteration, at_s}`` (work
    stealing); each membership change ``{attempt, event, rank, iteration, at_s}`` (``out`` or
    ``rejoined``, coordination.elastic), as the master recorded it.
    """
    times = [ev["t"] for _, logs in per_attempt for evs in logs.values() for ev in evs if _is_number(ev.get("t"))]
    if not times:
        return {"origin_t": None, "attempts": [], "segments": [], "steals": [], "membership": []}
    origin = min(times)
    attempts, segments, steals, membership = [], [], [], []
    for a, logs in per_attempt:
        ts = [ev["t"] for evs in logs.values() for ev in evs if _is_number(ev.get("t"))]
        attempts.append({"attempt": a, "start_s": min(ts) - origin, "end_s": max(ts) - origin, "ranks": sorted(logs)})
        for r, evs in sorted(logs.items()):
            steals += [{"attempt": a, "rank": r, "victim": ev.get("victim"), "split": ev.get("split"), "chunk": ev.get("chunk"),
                        "tasks": ev.get("tasks"), "iteration": ev.get("iteration"), "at_s": ev["t"] - origin}
                       for ev in evs if ev.get("event") == Event.STEAL and _is_number(ev.get("t"))]
            membership += [{"attempt": a, "event": ev["event"], "rank": ev.get("who"), "iteration": ev.get("iteration"),
                            "at_s": ev["t"] - origin}
                           for ev in evs if ev.get("event") in (Event.OUT, Event.REJOINED) and _is_number(ev.get("t"))]
            for s in rank_segments(evs):
                segments.append({
                    "attempt": a,
                    "rank": r,
                    "kind": s["kind"],
                    "iteration": s["iteration"],
                    "phase": s["phase"],
                    "label": _label(s["phase"]),
                    "start_s": s["t_start"] - origin,
                    "end_s": s["t_end"] - origin,
                    "seconds": s["seconds"],
                    "complete": s["complete"],
                })
    return {"origin_t": origin, "attempts": attempts, "segments": segments, "steals": steals, "membership": membership}


def _label(phase) -> str:
    try:
        return Phase(phase).label
    except (ValueError, TypeError):
        return str(phase)


def barrier_waits(segments: Iterable[dict]) -> list[dict]:
    """Barrier wait by (phase, rank) over all iterations and attempts: ``{phase, label, rank,
    count, total_s, mean_s, max_s}``, sorted by phase then rank. Only ``wait`` segments count
    (a master's decision time is not waiting)."""
    acc: dict[tuple[int, int], list[float]] = {}
    for s in segments:
        if s["kind"] == "wait" and isinstance(s["phase"], int):
            acc.setdefault((s["phase"], s["rank"]), []).append(s["seconds"])
    return [
        {"phase": p, "label": _label(p), "rank": r, "count": len(v), "total_s": sum(v), "mean_s": sum(v) / len(v), "max_s": max(v)}
        for (p, r), v in sorted(acc.items())
    ]


def iteration_timing(logs: list[tuple[str, dict[int, list[dict]]]]) -> dict[int, dict]:
    """Each iteration's time breakdown, as ``status --json`` gives it (:func:`timing.iteration_timing`)."""
    return timing.iteration_timing([(a, r, timing.LogDigest.of(evs)) for a, by_rank in logs for r, evs in by_rank.items()])


def iteration_rows(layout: RunLayout, evals: list[dict], trains: list[dict], segments: list[dict],
                   times: dict[int, dict]) -> list[dict]:
    """One row per iteration seen anywhere (summary, metrics, aggregate or events): the
    table of the HTML page. ``master_s`` is the time rank 0 spent in the iteration's phases
    (work, wait and decide, over all attempts); ``timing`` the iteration's entry of ``times``
    (:func:`iteration_timing`), or None."""
    by_eval = {e["iteration"]: e for e in evals}
    by_train = {t["iteration"]: t for t in trains}
    master_s: dict[int, float] = {}
    for s in segments:
        if s["rank"] == 0 and isinstance(s["iteration"], int):
            master_s[s["iteration"]] = master_s.get(s["iteration"], 0.0) + s["seconds"]
    summaries = {i: summary.read(layout, i) for i in _iteration_numbers(layout)}
    numbers = sorted({i for i, s in summaries.items() if s is not None} | set(by_eval) | set(by_train) | set(master_s))
    rows = []
    for i in numbers:
        s = summaries.get(i) or {}
        e = by_eval.get(i, {})
        rows.append({
            "iteration": i,
            "tasks_per_rank": s.get("tasks_per_rank"),
            "tasks_done_per_rank": s.get("tasks_done_per_rank"),
            "tasks_taken_per_rank": s.get("tasks_taken_per_rank"),
            "trajectories": s.get("trajectories"),
            "train_mean_reward": by_train.get(i, {}).get("mean_reward"),
            "evaluated": bool(s.get("evaluated")) or i in by_eval,
            "eval_accuracy": e.get("accuracy"),
            "eval_mean_reward": e.get("mean_reward"),
            "eval_pass_at_k": e.get("pass_at_k"),
            "checkpoint": s.get("checkpoint"),
            "complete": bool(s.get("complete")),
            "master_s": master_s.get(i),
            "timing": times.get(i),
        })
    return rows


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


# -- charts ----------------------------------------------------------------------------------


def _figure(width: float, height: float):
    """A figure drawn by the Agg canvas, without pyplot (no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _phase_colour(phase) -> str:
    return PHASE_COLOURS[phase % len(PHASE_COLOURS)] if isinstance(phase, int) else "black"


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def curves_png(data: dict) -> bytes:
    """Eval metrics (left) and the mean train reward (right) per iteration."""
    fig = _figure(10, 3.6)
    left, right = fig.subplots(1, 2)
    evals = data["eval"]
    drawn = False
    for key, name, style in EVAL_SERIES:
        pts = [(e["iteration"], e[key]) for e in evals if _is_number(e.get(key))]
        if pts:
            xs, ys = zip(*pts)
            left.plot(xs, ys, label=name, **style)
            drawn = True
    if drawn:
        left.set_title("evaluation")
        left.set_xlabel("iteration")
        left.legend(loc="best", fontsize="small")
        left.grid(alpha=0.3)
        left.xaxis.get_major_locator().set_params(integer=True)
    else:
        _empty(left, "no evaluated iteration yet")
    pts = [(t["iteration"], t["mean_reward"]) for t in data["train"] if _is_number(t.get("mean_reward"))]
    if pts:
        xs, ys = zip(*pts)
        right.plot(xs, ys, marker="o", color="tab:green", linewidth=2, label="train mean reward")
        right.set_title("train rollout")
        right.set_xlabel("iteration")
        right.legend(loc="best", fontsize="small")
        right.grid(alpha=0.3)
        right.xaxis.get_major_locator().set_params(integer=True)
    else:
        _empty(right, "no train aggregate yet")
    return _png(fig)


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 2 * 3600:
        return 3600.0, "hours"
    if span_s > 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


def timeline_png(data: dict) -> bytes:
    """One row per rank: work (full bars), barrier wait (thin, pale) and the master's
    decisions (hatched), coloured by phase; a dashed line where each attempt starts."""
    from matplotlib.patches import Patch

    tl = data["timeline"]
    segs = tl["segments"]
    ranks = sorted({s["rank"] for s in segs})
    fig = _figure(11, min(1.6 + 0.45 * max(len(ranks), 1), 14))
    ax = fig.subplots()
    if not segs:
        _empty(ax, "no event logs")
        return _png(fig)
    span = max(s["start_s"] + s["seconds"] for s in segs)
    unit, unit_name = _time_unit(span)
    row = {r: k for k, r in enumerate(ranks)}
    groups: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for s in segs:
        groups.setdefault((s["rank"], s["kind"], s["phase"]), []).append((s["start_s"] / unit, s["seconds"] / unit))
    style = {"work": (0.8, 1.0, None), "wait": (0.3, 0.35, None), "decide": (0.8, 0.9, "///")}
    for (rank, kind, phase), bars in groups.items():
        height, alpha, hatch = style[kind]
        y = row[rank] - height / 2
        ax.broken_barh(bars, (y, height), facecolors=_phase_colour(phase), alpha=alpha,
                       hatch=hatch, edgecolor="none" if hatch is None else "black", linewidth=0)
    steals = tl.get("steals") or []
    for st in steals:
        ax.plot(st["at_s"] / unit, row[st["rank"]], marker="<", color="black", markersize=4, linestyle="none")
    changes = [m for m in tl.get("membership") or [] if m["rank"] in row]
    for m in changes:
        ax.plot(m["at_s"] / unit, row[m["rank"]], marker="X" if m["event"] == Event.OUT else "P",
                color="red" if m["event"] == Event.OUT else "green", markersize=7, linestyle="none")
    for a in tl["attempts"]:
        ax.axvline(a["start_s"] / unit, color="black", linestyle="--", linewidth=0.8)
        ax.text(a["start_s"] / unit, 0.01, " " + a["attempt"], fontsize="x-small", va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5 + 0.5, -0.5)
    ax.set_xlabel(f"{unit_name} since the run's first event")
    ax.grid(axis="x", alpha=0.3)
    phases = sorted({s["phase"] for s in segs if isinstance(s["phase"], int)})
    handles = [Patch(facecolor=_phase_colour(p), label=_label(p)) for p in phases]
    handles += [Patch(facecolor="grey", alpha=0.35, label="barrier wait (thin)"),
                Patch(facecolor="white", edgecolor="black", hatch="///", label="master decides")]
    if steals:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="<", color="black", linestyle="none", markersize=4, label="took a chunk of another rank"))
    if changes:
        from matplotlib.lines import Line2D

        handles += [Line2D([], [], marker="X", color="red", linestyle="none", label="marked out (elastic)"),
                    Line2D([], [], marker="P", color="green", linestyle="none", label="rejoined")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize="x-small")
    ax.set_title("per-rank phase timeline")
    return _png(fig)


def barrier_wait_png(data: dict) -> bytes:
    """A heatmap of the total barrier wait in seconds, phases down, ranks across."""
    waits = data["barrier_wait"]
    ranks = sorted({w["rank"] for w in waits})
    phases = sorted({w["phase"] for w in waits})
    fig = _figure(min(max(7.0, 3.5 + 0.7 * len(ranks)), 16), 1.5 + 0.35 * max(len(phases), 1))
    ax = fig.subplots()
    if not waits:
        _empty(ax, "no barrier waits")
        return _png(fig)
    grid = [[math.nan] * len(ranks) for _ in phases]
    col = {r: k for k, r in enumerate(ranks)}
    line = {p: k for k, p in enumerate(phases)}
    for w in waits:
        grid[line[w["phase"]]][col[w["rank"]]] = w["total_s"]
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="total wait (s)")
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_yticks(range(len(phases)), [_label(p) for p in phases])
    ax.set_xlabel("rank")
    ax.set_title("barrier wait per phase and rank\n(total seconds over all iterations and attempts)", fontsize="medium")
    if len(ranks) * len(phases) <= 400:
        top = max((v for row in grid for v in row if not math.isnan(v)), default=0.0)
        for k in line.values():
            for c in col.values():
                v = grid[k][c]
                if not math.isnan(v):
                    ax.text(c, k, _short_seconds(v), ha="center", va="center", fontsize="x-small",
                            color="black" if top and v > 0.6 * top else "white")
    return _png(fig)


# The parts of the train and engine phases, in the order they are stacked: train in reds
# (the train phase's colour), engines in oranges (the engine restart's), darker as they come later.
TRAIN_PARTS = (
    ("train.startup", "#fcbba1"), ("train.load", "#fc9272"), ("train.prepare", "#fb6a4a"),
    ("train.steps", "#de2d26"), ("train.checkpoint", "#a50f15"),
)
ENGINE_PARTS = (("engine.start", "#fdd0a2"), ("engine.restart", "#fdae6b"), ("engine.reload", "#e6550d"), ("engine.release", "#a63603"))
TRAIN_REST = "train.total, rest"


def _stack(ax, xs: list, series: list[tuple[str, str, list[float]]], width: float) -> None:
    """Bars at ``xs`` stacked in the order of ``series`` (name, colour, one height per x)."""
    bottom = [0.0] * len(xs)
    for name, colour, ys in series:
        if any(ys):
            ax.bar(xs, ys, bottom=bottom, width=width, color=colour, label=name)
            bottom = [b + y for b, y in zip(bottom, ys)]


def _seconds_axes(ax, title: str) -> None:
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="x-small")  # top of the stack first


def breakdown_png(data: dict) -> bytes:
    """Per iteration: the master's seconds in each phase, stacked (left); and inside the
    train and engine phases, the slowest actor's seconds in each part (right: a train bar and
    an engine bar per iteration; ``train.total`` beyond its listed parts is drawn as the rest)."""
    timed = [(r["iteration"], r["timing"]) for r in data["iterations"] if r.get("timing")]
    xs = [i for i, _ in timed]
    fig = _figure(11, 3.8)
    left, right = fig.subplots(1, 2)
    phases = sorted({int(lbl.split(":")[0]) for _, t in timed for lbl in t["phases"]})
    if phases:
        _stack(left, xs, [(_label(p), _phase_colour(p), [t["phases"].get(_label(p), 0.0) for _, t in timed]) for p in phases], 0.8)
        _seconds_axes(left, "time per phase (master)")
    else:
        _empty(left, "no phase durations in the master's event log")
    if not any(t["parts"] for _, t in timed):
        _empty(right, "no train or engine timings recorded\n(a rehearsal run records none)")
        return _png(fig)
    train = [(name, colour, [t["parts"].get(name, 0.0) for _, t in timed]) for name, colour in TRAIN_PARTS]
    listed = [sum(v) for v in zip(*(ys for _, _, ys in train))]
    rest = [max(0.0, t["parts"].get("train.total", 0.0) - s) for (_, t), s in zip(timed, listed)]
    _stack(right, [x - 0.2 for x in xs], [*train, (TRAIN_REST, "#dddddd", rest)], 0.38)
    _stack(right, [x + 0.2 for x in xs], [(name, colour, [t["parts"].get(name, 0.0) for _, t in timed]) for name, colour in ENGINE_PARTS], 0.38)
    _seconds_axes(right, "inside train (left bars) and engine phases (right bars):\nthe slowest rank, train worker or engine")
    return _png(fig)


def _short_seconds(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


# -- HTML ------------------------------------------------------------------------------------


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, list):
        return ":".join(str(x) for x in v)
    return str(v)


def _time_tables(rows: list[dict]) -> str:
    """Two tables of seconds per iteration: the master's phases, and the train and engine
    parts (only when the run recorded any)."""
    e = html.escape
    timed = [r for r in rows if r.get("timing")]
    out = []
    phases = sorted({lbl for r in timed for lbl in r["timing"]["phases"]}, key=lambda lbl: int(lbl.split(":")[0]))
    parts = sorted({p for r in timed for p in r["timing"]["parts"]}, key=timing.part_sort_key)
    for keys, of_phases, caption in ((phases, True, "seconds per phase (master)"), (parts, False, "slowest rank, worker or engine (s)")):
        if not keys:
            continue
        head = "<th>iteration</th>" + ("<th>total</th>" if of_phases else "") + "".join(f"<th>{e(k)}</th>" for k in keys)
        body = []
        for r in timed:
            t = r["timing"]
            figures = t["phases"] if of_phases else t["parts"]
            cells = ([t["total_s"]] if of_phases else []) + [figures.get(k) for k in keys]
            body.append(f"<tr><td>{r['iteration']}</td>" + "".join(f"<td>{e(_cell(v))}</td>" for v in cells) + "</tr>")
        out.append(f'<table class="time">\n<caption>{e(caption)}</caption>\n<tr>{head}</tr>\n' + "\n".join(body) + "\n</table>")
    return "\n".join(out)


def index_html(data: dict) -> str:
    """One static page (no JavaScript): the charts, referenced by relative file name, a
    table of the per-iteration figures and tables of where each iteration's time went."""
    e = html.escape
    columns = [("iteration", "iteration"), ("tasks_per_rank", "tasks/rank"), ("tasks_done_per_rank", "done/rank"),
               ("tasks_taken_per_rank", "taken from"), ("trajectories", "trajectories"),
               ("train_mean_reward", "train mean reward"), ("eval_accuracy", "eval accuracy"),
               ("eval_pass_at_k", "eval pass@k"), ("eval_mean_reward", "eval mean reward"),
               ("master_s", "rank 0 time (s)"), ("complete", "complete")]
    head = "".join(f"<th>{e(name)}</th>" for _, name in columns)
    body = "\n".join(
        "<tr>" + "".join(f"<td>{e(_cell(row.get(key)))}</td>" for key, _ in columns) + "</tr>" for row in data["iterations"]
    )
    attempts = ", ".join(e(a["attempt"]) for a in data["timeline"]["attempts"]) or "none"
    time_tables = _time_tables(data["iterations"])
    generated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["generated_at"]))
    charts = data["charts"]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>orchestrator report: {e(data['log_path'])}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }}
th {{ background: #eee; }}
img {{ max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0 1.5em; }}
.note {{ color: #666; font-size: 0.9em; }}
caption {{ text-align: left; color: #666; font-size: 0.9em; }}
</style>
</head>
<body>
<h1>Run report</h1>
<p>log path <code>{e(data['log_path'])}</code> &middot; generated {e(generated)} &middot; attempts: {attempts}</p>
<h2>Per iteration</h2>
<table>
<tr>{head}</tr>
{body}
</table>
<p class="note">The numbers are also in <a href="{REPORT_JSON}">{REPORT_JSON}</a>.</p>
<h2>Reward and evaluation</h2>
<img src="{e(charts['curves'])}" alt="eval metrics and train mean reward per iteration">
<h2>Where each iteration's time went</h2>
<p class="note">Left: the master's seconds in each phase, work and barrier wait together. Right: inside the train phase
and the engine phases (rollout, eval, engine stop, engine restart), the slowest rank, train worker or engine in each part;
<code>train.total</code> is a rank's whole wait for its trainers.</p>
<img src="{e(charts['breakdown'])}" alt="time per phase and inside train and engine phases, per iteration">
{time_tables}
<h2>Per-rank phase timeline</h2>
<p class="note">Full bars: a phase's work; thin pale bars: waiting at the phase's barrier; hatched: the master's decision.
Rows are placed by each rank's wall clock.</p>
<img src="{e(charts['timeline'])}" alt="per-rank phase timeline">
<h2>Barrier wait per phase and rank</h2>
<img src="{e(charts['barrier_wait'])}" alt="barrier wait per phase and rank">
</body>
</html>
"""


# -- writing ---------------------------------------------------------------------------------


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
