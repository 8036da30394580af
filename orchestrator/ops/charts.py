"""The report's charts: each one PNG drawn with matplotlib from the data ``report.collect``
returned (``report.json``), so a chart shows exactly the figures the JSON and the page hold.

Each chart is built as a figure (``*_figure``, which tests inspect) and written as a PNG
(``*_png``). Figures are drawn by the Agg canvas without pyplot, which keeps no global backend
state in a process that may draw several reports; matplotlib is imported only when a chart is
drawn, so `status` and the CLI start without it.
"""

from __future__ import annotations

import io
import math

from orchestrator.ops.event_fold import is_number, phase_label
from orchestrator.protocol.wire import Event

# The eval metrics drawn on the curves chart (when the run recorded them): key, name, style,
# in legend order. Under an exact-match reward (every reward 0 or 1) the mean reward equals
# the accuracy at every point, so the two must not look alike: the mean reward is drawn
# underneath, wide, pale, dashed, with hollow diamonds; the accuracy on top, solid, with filled
# circles that sit inside the diamonds where the two meet.
EVAL_SERIES = (
    ("accuracy", "eval accuracy", {"color": "tab:blue", "marker": "o", "linestyle": "-", "linewidth": 2, "zorder": 4}),
    ("pass_at_k", "eval pass@k", {"color": "tab:orange", "marker": "s", "linestyle": "-.", "linewidth": 1.5, "zorder": 3}),
    ("mean_reward", "eval mean reward", {"color": ("tab:purple", 0.4), "marker": "D", "markersize": 12,
                                         "markerfacecolor": "none", "markeredgecolor": "tab:purple", "markeredgewidth": 1.2,
                                         "linestyle": "--", "linewidth": 6, "zorder": 2}),
)
TRAIN_SERIES_STYLE = {"color": "tab:green", "marker": "o", "linestyle": "-", "linewidth": 2}

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


def curves_figure(data: dict):
    """Eval metrics (left) and the mean train reward (right) per iteration, over the same
    iterations; a score axis from 0 to 1 when every value lies there (accuracies, pass@k and
    0/1 rewards), so a small change does not fill the chart."""
    fig = _figure(10, 4.2)
    left, right = fig.subplots(1, 2)
    evals = data["eval"]
    drawn = []
    for key, name, style in EVAL_SERIES:
        pts = [(e["iteration"], e[key]) for e in evals if is_number(e.get(key))]
        if pts:
            xs, ys = zip(*pts)
            if key == "mean_reward" and _coincides_with_accuracy(evals):
                name += " (= accuracy)"
            left.plot(xs, ys, label=name, **style)
            drawn += pts
    pts = [(t["iteration"], t["mean_reward"]) for t in data["train"] if is_number(t.get("mean_reward"))]
    xs = [x for x, _ in drawn + pts]
    if drawn:
        _iteration_axes(left, "evaluation", "accuracy, pass@k (fraction)\nor mean reward", [y for _, y in drawn], xs)
    else:
        _empty(left, "no evaluated iteration yet")
    if pts:
        right.plot(*zip(*pts), label="train mean reward", **TRAIN_SERIES_STYLE)
        _iteration_axes(right, "train rollout", "mean reward per sample", [y for _, y in pts], xs)
    else:
        _empty(right, "no train aggregate yet")
    return fig


def curves_png(data: dict) -> bytes:
    return _png(curves_figure(data))


def _coincides_with_accuracy(evals: list[dict]) -> bool:
    both = [(e["accuracy"], e["mean_reward"]) for e in evals if is_number(e.get("accuracy")) and is_number(e.get("mean_reward"))]
    return bool(both) and all(math.isclose(a, r, abs_tol=1e-9) for a, r in both)


def _iteration_axes(ax, title: str, ylabel: str, ys: list[float], xs: list[int]) -> None:
    """Title, axis titles, legend and grid of a curve over iterations: whole numbers on the x
    axis, spanning ``xs`` (the iterations of both curve panels, so they line up); y from 0 to 1
    when every value in ``ys`` lies there."""
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    if all(0.0 <= y <= 1.0 for y in ys):
        ax.set_ylim(-0.03, 1.03)
    ax.set_xlim(min(xs) - 0.4, max(xs) + 0.4)
    # below the axes: on a 0..1 axis no corner is sure to be free of the curves
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize="small", frameon=False)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 2 * 3600:
        return 3600.0, "hours"
    if span_s > 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


# Iteration starts on the timeline: a line at each, its label "it N" on the top axis unless
# it would overlap the previous label (at most this many labels across the chart).
ITERATION_LINE = {"color": "0.3", "linestyle": ":", "linewidth": 1.1}
MAX_ITERATION_LABELS = 30
ATTEMPT_LINE = {"color": "black", "linestyle": "--", "linewidth": 1.2}


def timeline_figure(data: dict):
    """One row per rank: work (full bars), barrier wait (thin, pale) and the master's
    decisions (hatched), coloured by phase; a dotted line labelled "it N" where each iteration
    starts and a dashed one where each attempt starts."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    tl = data["timeline"]
    segs = tl["segments"]
    ranks = sorted({s["rank"] for s in segs})
    legend_rows = math.ceil((len({s["phase"] for s in segs}) + 6) / 5)
    fig = _figure(11, min(1.9 + 0.45 * max(len(ranks), 1) + 0.25 * legend_rows, 16))
    ax = fig.subplots()
    if not segs:
        _empty(ax, "no event logs")
        return fig
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
    starts = tl.get("iterations") or []
    _iteration_lines(ax, [(it["start_s"] / unit, it["iteration"]) for it in starts], span / unit)
    for a in tl["attempts"]:
        ax.axvline(a["start_s"] / unit, **ATTEMPT_LINE)
        ax.text(a["start_s"] / unit, 0.01, " " + a["attempt"], fontsize="x-small", va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_ylim(len(ranks) - 0.5 + 0.5, -0.5)
    ax.set_ylabel("rank")
    ax.set_xlabel(f"{unit_name} since the run's first event")
    ax.grid(axis="x", alpha=0.3)
    phases = sorted({s["phase"] for s in segs if isinstance(s["phase"], int)})
    handles = [Patch(facecolor=_phase_colour(p), label=phase_label(p)) for p in phases]
    handles += [Patch(facecolor="grey", alpha=0.35, label="barrier wait (thin)"),
                Patch(facecolor="white", edgecolor="black", hatch="///", label="master decides")]
    if starts:
        handles.append(Line2D([], [], label="iteration starts (it N)", **ITERATION_LINE))
    handles.append(Line2D([], [], label="attempt starts", **ATTEMPT_LINE))
    if steals:
        handles.append(Line2D([], [], marker="<", color="black", linestyle="none", markersize=4, label="took a chunk of another rank"))
    if changes:
        handles += [Line2D([], [], marker="X", color="red", linestyle="none", label="marked out (elastic)"),
                    Line2D([], [], marker="P", color="green", linestyle="none", label="rejoined")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize="small")
    ax.set_title("per-rank phase timeline")
    return fig


def timeline_png(data: dict) -> bytes:
    return _png(timeline_figure(data))


def _iteration_lines(ax, starts: list[tuple[float, int]], span: float) -> None:
    """A line at each iteration's start (``starts``: position, iteration) and its label "it N"
    on a top axis; a label closer than 1/MAX_ITERATION_LABELS of the span to the last one
    shown is left out (its line stays), so labels never overlap."""
    ticks, labels = [], []
    for x, i in starts:
        ax.axvline(x, **ITERATION_LINE)
        if not ticks or x - ticks[-1] >= span / MAX_ITERATION_LABELS:
            ticks.append(x)
            labels.append(f"it {i}")
    if ticks:
        top = ax.secondary_xaxis("top")
        top.set_xticks(ticks, labels, fontsize="x-small")
        top.tick_params(length=3)


# The barrier-wait colours run from 0 (white) to the longest total wait, but never to less
# than this: a run whose barriers all clear in milliseconds stays pale instead of stretching
# its noise over the whole palette.
WAIT_SCALE_MIN_S = 1.0
WAIT_CMAP = "Reds"


def wait_scale(waits: list[dict]) -> tuple[float, float]:
    """The seconds at the two ends of the barrier wait's colour scale: 0 and the longest
    total wait, or :data:`WAIT_SCALE_MIN_S` when that is longer."""
    return 0.0, max([WAIT_SCALE_MIN_S, *(w["total_s"] for w in waits)])


def barrier_wait_figure(data: dict):
    """A heatmap of the total barrier wait in seconds, phases down, ranks across, coloured on
    :func:`wait_scale` (white is no wait) with its colour bar; each cell shows its seconds."""
    from matplotlib.colors import Normalize

    waits = data["barrier_wait"]
    ranks = sorted({w["rank"] for w in waits})
    phases = sorted({w["phase"] for w in waits})
    if not waits or max(w["total_s"] for w in waits) < 0.005:
        fig = _figure(6, 1.6)
        _empty(fig.subplots(), "no barrier waits" if not waits else
               f"every barrier of every rank ({len(ranks)}) cleared in under 0.01 s in total:\nno wait to draw")
        return fig
    fig = _figure(min(max(5.0, 3.6 + 0.6 * len(ranks)), 16), 1.9 + 0.35 * max(len(phases), 1))
    ax = fig.subplots()
    grid = [[math.nan] * len(ranks) for _ in phases]
    col = {r: k for k, r in enumerate(ranks)}
    line = {p: k for k, p in enumerate(phases)}
    for w in waits:
        grid[line[w["phase"]]][col[w["rank"]]] = w["total_s"]
    norm = Normalize(*wait_scale(waits))
    im = ax.imshow(grid, aspect="auto", cmap=WAIT_CMAP, norm=norm, interpolation="nearest")
    bar = fig.colorbar(im, ax=ax)
    bar.set_label(f"total wait (seconds)\ncolours from 0 to at least {WAIT_SCALE_MIN_S:g} s", fontsize="small")
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_yticks(range(len(phases)), [phase_label(p) for p in phases])
    ax.set_xlabel("rank")
    ax.set_ylabel("phase (its barrier)")
    ax.set_title("barrier wait per phase and rank\n(total seconds over all iterations and attempts)", fontsize="medium")
    if len(ranks) * len(phases) <= 400:
        for k in line.values():
            for c in col.values():
                v = grid[k][c]
                text, colour = ("none", "grey") if math.isnan(v) else (_short_seconds(v), "white" if norm(v) > 0.6 else "black")
                ax.text(c, k, text, ha="center", va="center", fontsize="x-small", color=colour)
    return fig


def barrier_wait_png(data: dict) -> bytes:
    return _png(barrier_wait_figure(data))


# The parts of the train and engine phases, in the order they are stacked: train in reds
# (the train phase's colour), engines in blues (apart from the reds at a glance), darker as
# they come later.
TRAIN_PARTS = (
    ("train.startup", "#fcbba1"), ("train.load", "#fc9272"), ("train.replay", "#fc8d59"), ("train.prepare", "#fb6a4a"),
    ("train.steps", "#de2d26"), ("train.checkpoint", "#a50f15"),
)
ENGINE_PARTS = (("engine.rebuild", "#deebf7"), ("engine.start", "#c6dbef"), ("engine.restart", "#6baed6"), ("engine.reload", "#2171b5"), ("engine.release", "#08306b"))
TRAIN_REST = "train.total, rest"


def _stack(ax, xs: list, series: list[tuple[str, str, list[float]]], width: float) -> float:
    """Bars at ``xs`` stacked in the order of ``series`` (name, colour, one height per x);
    returns the highest stack."""
    bottom = [0.0] * len(xs)
    for name, colour, ys in series:
        if any(ys):
            ax.bar(xs, ys, bottom=bottom, width=width, color=colour, label=name)
            bottom = [b + y for b, y in zip(bottom, ys)]
    return max(bottom, default=0.0)


def _seconds_axes(ax, title: str, top: float) -> None:
    """Titles, legend and grid of stacked seconds per iteration up to ``top``. The y range is
    set here: a zero-height bar on top of a stack pins autoscaling's upper edge to the highest
    stack (a sticky edge), which would clip it against the frame."""
    ax.set_ylim(0, 1.06 * top if top > 0 else 1.0)
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="x-small")  # top of the stack first


def breakdown_figure(data: dict):
    """Per iteration: the master's seconds in each phase, stacked (left); and inside the
    train and engine phases, the slowest actor's seconds in each part (right: a train bar and
    an engine bar per iteration; ``train.total`` beyond its listed parts is drawn as the rest)."""
    timed = [(r["iteration"], r["timing"]) for r in data["iterations"] if r.get("timing")]
    xs = [i for i, _ in timed]
    fig = _figure(11, 3.8)
    left, right = fig.subplots(1, 2)
    phases = sorted({int(lbl.split(":")[0]) for _, t in timed for lbl in t["phases"]})
    if phases:
        top = _stack(left, xs, [(phase_label(p), _phase_colour(p), [t["phases"].get(phase_label(p), 0.0) for _, t in timed])
                                for p in phases], 0.8)
        _seconds_axes(left, "time per phase (master)", top)
    else:
        _empty(left, "no phase durations in the master's event log")
    if not any(t["parts"] for _, t in timed):
        _empty(right, "no train or engine timings recorded\n(a rehearsal run records none)")
        return fig
    train = [(name, colour, [t["parts"].get(name, 0.0) for _, t in timed]) for name, colour in TRAIN_PARTS]
    listed = [sum(v) for v in zip(*(ys for _, _, ys in train))]
    rest = [max(0.0, t["parts"].get("train.total", 0.0) - s) for (_, t), s in zip(timed, listed)]
    top = _stack(right, [x - 0.2 for x in xs], [*train, (TRAIN_REST, "#dddddd", rest)], 0.38)
    engine = [(name, colour, [t["parts"].get(name, 0.0) for _, t in timed]) for name, colour in ENGINE_PARTS]
    top = max(top, _stack(right, [x + 0.2 for x in xs], engine, 0.38))
    _seconds_axes(right, "inside train (left bars) and engine phases (right bars):\nthe slowest rank, train worker or engine", top)
    return fig


def breakdown_png(data: dict) -> bytes:
    return _png(breakdown_figure(data))


def _short_seconds(v: float) -> str:
    if v == 0:
        return "0"
    if v < 0.005:
        return "<0.01"
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"
