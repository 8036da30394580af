"""The report's charts as a reader sees them: the eval curves that coincide under a 0/1 reward
both stay visible, every axis says what it counts, the timeline marks each iteration's start,
and the barrier-wait colours start at 0 so milliseconds of noise stay pale. Checked on the
matplotlib figures the PNGs are written from."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_rgba

from orchestrator.ops import charts
from orchestrator.ops.event_fold import RankLog
from orchestrator.ops.timeline import iteration_starts, timeline

# An exact-match run: the eval mean reward equals the accuracy at every point.
EVALS = [{"iteration": i, "accuracy": a, "mean_reward": a, "pass_at_k": p}
         for i, a, p in ((1, 0.28, 0.56), (3, 0.44, 0.8))]
TRAINS = [{"iteration": i, "mean_reward": r, "records": 64, "samples": 512} for i, r in ((1, 0.2), (2, 0.19), (3, 0.23), (4, 0.29))]


def _lines_by_label(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def _drawn(fig):
    fig.canvas.draw()  # tick labels get their text when drawn
    return fig


def _tick_texts(labels) -> list[str]:
    return [t.get_text() for t in labels if t.get_text()]


# -- the curves ------------------------------------------------------------------------------


def test_accuracy_and_an_equal_mean_reward_differ_in_colour_dash_and_marker_with_accuracy_on_top():
    left, right = charts.curves_figure({"eval": EVALS, "train": TRAINS}).axes
    lines = _lines_by_label(left)
    acc, reward = lines["eval accuracy"], lines["eval mean reward (= accuracy)"]
    assert list(acc.get_ydata()) == list(reward.get_ydata()) == [0.28, 0.44]
    assert to_rgba(acc.get_color())[:3] != to_rgba(reward.get_color())[:3]
    assert acc.get_linestyle() == "-" and reward.get_linestyle() == "--"
    assert acc.get_marker() == "o" and reward.get_marker() == "D" and reward.get_markerfacecolor() == "none"
    # the accuracy on top, thinner than the band under it, its circles inside the hollow diamonds
    assert acc.get_zorder() > reward.get_zorder()
    assert acc.get_linewidth() < reward.get_linewidth() and acc.get_markersize() < reward.get_markersize()
    legend = [t.get_text() for t in left.get_legend().get_texts()]
    assert legend == ["eval accuracy", "eval pass@k", "eval mean reward (= accuracy)"]
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["train mean reward"]


def test_a_mean_reward_that_differs_from_accuracy_is_not_called_equal():
    evals = [{**e, "mean_reward": e["accuracy"] + 0.1} for e in EVALS]
    left = charts.curves_figure({"eval": evals, "train": []}).axes[0]
    assert "eval mean reward" in _lines_by_label(left)


def test_curves_have_titled_axes_from_0_to_1_over_the_same_iterations():
    left, right = _drawn(charts.curves_figure({"eval": EVALS, "train": TRAINS})).axes
    assert "accuracy" in left.get_ylabel() and "mean reward" in left.get_ylabel()
    assert right.get_ylabel() == "mean reward per sample"
    for ax in (left, right):
        assert ax.get_xlabel() == "iteration"
        assert ax.get_ylim()[0] < 0 < 1 < ax.get_ylim()[1] < 1.1
        assert {"0.0", "0.2", "0.4", "0.6", "0.8", "1.0"} <= set(_tick_texts(ax.get_yticklabels()))
    # evaluated iterations 1 and 3 line up with the train reward's 1 to 4
    assert left.get_xlim() == right.get_xlim() and left.get_xlim()[0] < 1 and left.get_xlim()[1] > 4


def test_a_reward_outside_0_to_1_keeps_an_axis_that_fits_it():
    right = charts.curves_figure({"eval": [], "train": [{"iteration": 1, "mean_reward": -2.0}, {"iteration": 2, "mean_reward": 5.0}]}).axes[1]
    low, high = right.get_ylim()
    assert low <= -2.0 and high >= 5.0


# -- the timeline ----------------------------------------------------------------------------


def _ev(event: str, t: float, iteration: int, phase: int) -> dict:
    return {"event": event, "t": 1000.0 + t, "mono": t, "iteration": iteration, "phase": phase}


def _walk(rank: int, starts: list[float], attempt: str = "a000001-aaaaaa", first: int = 1, lag: float = 0.0) -> RankLog:
    """A rank walking iterations ``first, first+1, ...`` from ``starts`` (+ ``lag``): a rollout
    of 1 s, then a barrier phase it arrives at after 0.5 s and that releases at 2 s."""
    events = []
    for k, t in enumerate(starts):
        i, t = first + k, t + lag
        events += [_ev("phase", t, i, 1), _ev("phase", t + 1, i, 2), _ev("arrive", t + 1.5, i, 2), _ev("released", t + 2, i, 2)]
    return RankLog.of(events, attempt, rank)


def test_iteration_starts_are_the_first_rank_in_each_iteration_of_each_attempt():
    logs = [_walk(0, [0.0, 10.0, 20.0]), _walk(1, [0.0, 10.0, 20.0], lag=0.25),
            _walk(0, [40.0], attempt="a000002-bbbbbb", first=3)]  # iteration 3 again, after a failure
    starts = iteration_starts(timeline(logs)["segments"])
    assert starts == [{"attempt": "a000001-aaaaaa", "iteration": 1, "start_s": 0.0},
                      {"attempt": "a000001-aaaaaa", "iteration": 2, "start_s": 10.0},
                      {"attempt": "a000001-aaaaaa", "iteration": 3, "start_s": 20.0},
                      {"attempt": "a000002-bbbbbb", "iteration": 3, "start_s": 40.0}]
    assert timeline(logs)["iterations"] == starts


def _iteration_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_linestyle() == ":"]


def test_timeline_draws_one_labelled_line_per_iteration_start_and_titles_its_axes():
    tl = timeline([_walk(0, [0.0, 10.0, 20.0]), _walk(1, [0.0, 10.0, 20.0], lag=0.25)])
    fig = _drawn(charts.timeline_figure({"timeline": tl}))
    ax = fig.axes[0]
    top = ax.child_axes[0]  # the top axis of iteration labels
    lines = _iteration_lines(ax)
    assert [line.get_xdata()[0] for line in lines] == [0.0, 10.0, 20.0]
    assert _tick_texts(top.get_xticklabels()) == ["it 1", "it 2", "it 3"]
    assert list(top.get_xticks()) == [0.0, 10.0, 20.0]
    assert ax.get_ylabel() == "rank" and _tick_texts(ax.get_yticklabels()) == ["0", "1"]
    assert ax.get_xlabel() == "seconds since the run's first event"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "iteration starts (it N)" in legend and "attempt starts" in legend
    assert min(t.get_fontsize() for t in fig.legends[0].get_texts()) >= 8, "a legend of 14 phases must be legible"


def test_timeline_of_many_short_iterations_keeps_every_line_and_labels_that_do_not_overlap():
    starts = [10.0 * k for k in range(100)]
    tl = timeline([_walk(0, starts)])
    ax = _drawn(charts.timeline_figure({"timeline": tl})).axes[0]
    top = ax.child_axes[0]
    assert len(_iteration_lines(ax)) == 100
    ticks = list(top.get_xticks())
    assert len(ticks) <= charts.MAX_ITERATION_LABELS
    assert min(b - a for a, b in zip(ticks, ticks[1:])) >= ax.get_xlim()[1] / (charts.MAX_ITERATION_LABELS + 2)


# -- the barrier-wait heat map ---------------------------------------------------------------


def _waits(totals: dict[tuple[int, int], float]) -> list[dict]:
    return [{"phase": p, "label": str(p), "rank": r, "count": 3, "total_s": s, "mean_s": s / 3, "max_s": s}
            for (p, r), s in sorted(totals.items())]


def test_wait_colours_start_at_0_and_span_at_least_the_minimum():
    assert charts.wait_scale(_waits({(2, 0): 0.0085, (2, 1): 0.0105})) == (0.0, charts.WAIT_SCALE_MIN_S)
    assert charts.wait_scale(_waits({(2, 0): 0.5, (12, 1): 27.0})) == (0.0, 27.0)


def test_barrier_waits_all_under_a_hundredth_of_a_second_are_said_in_words_not_drawn_as_a_grid():
    fig = _drawn(charts.barrier_wait_figure({"barrier_wait": _waits({(2, 0): 0.003, (12, 0): 0.001, (13, 0): 0.0})}))
    ax = fig.axes[0]
    assert not ax.get_images() and "under 0.01 s" in " ".join(t.get_text() for t in ax.texts)
    assert fig.get_size_inches()[1] < 2


def test_engine_parts_are_another_hue_than_train_parts():
    """The breakdown stacks train parts in reds beside engine parts: the two must not look alike."""
    from matplotlib.colors import rgb_to_hsv

    def hue(colour):
        return float(rgb_to_hsv(to_rgba(colour)[:3])[0])

    def apart(a, b):
        return min(abs(a - b), 1 - abs(a - b))

    assert min(apart(hue(e), hue(t)) for _, e in charts.ENGINE_PARTS for _, t in charts.TRAIN_PARTS) > 0.25


def test_milliseconds_of_barrier_wait_are_drawn_in_the_palest_colour_with_a_scale_in_seconds():
    fig = _drawn(charts.barrier_wait_figure({"barrier_wait": _waits({(2, 0): 0.0085, (2, 1): 0.0105, (12, 0): 0.0095})}))
    ax = fig.axes[0]
    image = ax.get_images()[0]
    assert (image.norm.vmin, image.norm.vmax) == (0.0, charts.WAIT_SCALE_MIN_S)
    palest = image.cmap(0.0)
    for v in (0.0085, 0.0105):
        assert image.to_rgba(v) == pytest.approx(palest, abs=0.03)
    assert min(palest[:3]) > 0.9  # near white
    # the colour bar: the scale's values from 0 up, in seconds
    bar = image.colorbar
    assert bar is not None and "seconds" in bar.ax.get_ylabel()
    assert bar.vmin == 0.0 and bar.vmax == charts.WAIT_SCALE_MIN_S
    assert _tick_texts(bar.ax.get_yticklabels())[0] == "0.0"
    assert ax.get_xlabel() == "rank" and ax.get_ylabel().startswith("phase")


def test_a_long_barrier_wait_is_dark_and_short_ones_beside_it_stay_pale():
    image = charts.barrier_wait_figure({"barrier_wait": _waits({(2, 0): 9.72, (2, 1): 4.81, (2, 2): 0.02})}).axes[0].get_images()[0]
    assert (image.norm.vmin, image.norm.vmax) == (0.0, 9.72)
    assert image.to_rgba(9.72) == pytest.approx(image.cmap(1.0))
    assert image.to_rgba(0.02) == pytest.approx(image.cmap(0.0), abs=0.03)


def test_a_phase_and_rank_without_a_wait_read_none_not_zero():
    ax = charts.barrier_wait_figure({"barrier_wait": _waits({(2, 0): 1.5, (2, 1): 0.0, (6, 0): 0.003})}).axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["0", "1.50", "<0.01", "none"]


# -- the breakdown ---------------------------------------------------------------------------


def test_breakdown_axes_count_seconds_per_iteration_and_leave_room_above_the_highest_stack():
    rows = [{"iteration": 1, "timing": {"phases": {"1:rollout": 3.0, "10:train": 4.0}, "total_s": 7.0,
                                        "parts": {"train.startup": 2.0, "train.steps": 1.0, "train.total": 3.0,
                                                  "engine.start": 4.0}}},
            {"iteration": 2, "timing": {"phases": {"1:rollout": 0.5, "10:train": 1.0}, "total_s": 1.5,
                                        "parts": {"train.steps": 0.75, "train.checkpoint": 0.25, "train.total": 1.0}}}]
    for ax in _drawn(charts.breakdown_figure({"iterations": rows})).axes:
        assert ax.get_xlabel() == "iteration" and ax.get_ylabel() == "seconds"
        assert _tick_texts(ax.get_yticklabels())
    left, right = charts.breakdown_figure({"iterations": rows}).axes
    assert left.get_ylim()[1] > 7.0 and right.get_ylim()[1] > 4.0
