"""The one fold of the event logs that status and report share: two ranks' logs written by
hand into a real run directory, read once, give each iteration's phase times and the
barrier waits; status's reader (which skips a worker's lines without timing) gives the
same times."""

import json

import pytest

from orchestrator.ops import timing
from orchestrator.ops.event_fold import EventReader
from orchestrator.ops.timeline import barrier_waits, timeline
from orchestrator.protocol.layout import RunLayout

ATTEMPT = "a000001-aaaaaa"


def _write(layout: RunLayout, rank: int, *events: tuple) -> None:
    """``(event, iteration, phase, mono, extra fields)`` lines; wall time = 1000 + mono."""
    path = layout.attempt(ATTEMPT).events(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for event, iteration, phase, mono, *extra in events:
            line = {"event": event, "rank": rank, "t": 1000.0 + mono, "mono": mono, "iteration": iteration, "phase": phase,
                    **(extra[0] if extra else {})}
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


@pytest.fixture
def layout(tmp_path) -> RunLayout:
    """Iteration 1, phases 0 and 1: the master works 1 s in phase 0 and waits 2 s for rank 1,
    decides for 0.5 s; rank 1 works 3 s and waits 0.5 s; phase 1 has no barrier and ends,
    for the master, at the release of the last phase it walks (phase 2)."""
    layout = RunLayout(tmp_path / "run")
    _write(layout, 0,
           ("phase", 1, 0, 0.0), ("arrive", 1, 0, 1.0), ("all_arrived", 1, 0, 3.0), ("released", 1, 0, 3.5),
           ("phase", 1, 1, 3.5), ("phase", 1, 2, 5.0), ("arrive", 1, 2, 5.25), ("all_arrived", 1, 2, 5.5),
           ("released", 1, 2, 6.0))
    _write(layout, 1,
           ("phase", 1, 0, 0.0), ("arrive", 1, 0, 3.0), ("released", 1, 0, 3.5),
           ("phase", 1, 1, 3.5), ("timing", 1, 1, 3.75, {"part": "engine.reload", "seconds": 0.75, "engine": 0}),
           ("phase", 1, 2, 4.0), ("arrive", 1, 2, 5.5), ("released", 1, 2, 6.0))
    return layout


def test_one_read_gives_the_phase_times_and_the_barrier_waits(layout):
    logs = EventReader(layout, timeline=True).read()
    assert [(log.attempt, log.rank, log.events) for log in logs] == [(ATTEMPT, 0, 9), (ATTEMPT, 1, 8)]

    assert timing.iteration_timing(logs) == {1: {
        "phases": {"0:sync_start": 3.5, "1:rollout": 1.5, "2:rollout_done": 1.0},
        "total_s": 6.0,
        "parts": {"engine.reload": 0.75},
    }}

    waits = {(w["phase"], w["rank"]): (w["count"], w["total_s"]) for w in barrier_waits(timeline(logs)["segments"])}
    # the master's wait ends when the last rank arrives: its decision is not waiting
    assert waits == {(0, 0): (1, 2.0), (0, 1): (1, 0.5), (2, 0): (1, 0.25), (2, 1): (1, 0.5)}


def test_status_reader_skips_worker_lines_without_timing_and_gets_the_same_times(layout):
    everything = timing.iteration_timing(EventReader(layout, timeline=True).read())
    logs = EventReader(layout).read()
    assert timing.iteration_timing(logs) == everything
    assert logs[1].events == 1  # only rank 1's timing line was parsed
    assert logs[0].segments() == [] and logs[0].first_t is None  # and no spans kept: status draws none


def test_the_timeline_places_every_segment_from_the_runs_first_event(layout):
    tl = timeline(EventReader(layout, timeline=True).read())
    assert tl["origin_t"] == 1000.0
    assert tl["attempts"] == [{"attempt": ATTEMPT, "start_s": 0.0, "end_s": 6.0, "ranks": [0, 1]}]
    master = [(s["kind"], s["phase"], s["start_s"], s["seconds"]) for s in tl["segments"] if s["rank"] == 0]
    assert master == [("work", 0, 0.0, 1.0), ("wait", 0, 1.0, 2.0), ("decide", 0, 3.0, 0.5), ("work", 1, 3.5, 1.5),
                      ("work", 2, 5.0, 0.25), ("wait", 2, 5.25, 0.25), ("decide", 2, 5.5, 0.5)]
    assert all(s["complete"] for s in tl["segments"])
