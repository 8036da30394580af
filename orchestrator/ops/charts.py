"""The report's charts: each one PNG drawn with matplotlib from the data ``report.collect``
returned (``report.json``), so a chart shows exactly the figures the JSON and the page hold.

Figures are drawn by the Agg canvas without pyplot, which keeps no global backend state in a
process that may draw several reports; matplotlib is imported only when a chart is drawn, so
`status` and the CLI start without it.
"""

from __future__ import annotations

import io
import math

from orchestrator.ops.event_fold import is_number, phase_label
from orchestrator.protocol.api import Event

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
        pts = [(e["iteration"], e[key]) for e in evals if is_number(e.get(key))]
        if pts:
            xs, ys = zip(*pts)
            left.plot(xs, ys, label=name, **style)
            drawn = True
    if drawn:
        _iteration_axes(left, "evaluation")
    else:
        _empty(left, "no evaluated iteration yet")
    pts = [(t["iteration"], t["mean_reward"]) for t in data["train"] if is_number(t.get("mean_reward"))]
    if pts:
        xs, ys = zip(*pts)
        right.plot(xs, ys, marker="o", color="tab:green", linewidth=2, label="train mean reward")
        _iteration_axes(right, "train rollout")
    else:
        _empty(right, "no train aggregate yet")
    return _png(fig)


def _iteration_axes(ax, title: str) -> None:
    """Title, legend and grid of a curve over iterations (whole numbers on the x axis)."""
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


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
    handles = [Patch(facecolor=_phase_colour(p), label=phase_label(p)) for p in phases]
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
    ax.set_yticks(range(len(phases)), [phase_label(p) for p in phases])
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
        _stack(left, xs, [(phase_label(p), _phase_colour(p), [t["phases"].get(phase_label(p), 0.0) for _, t in timed]) for p in phases], 0.8)
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
