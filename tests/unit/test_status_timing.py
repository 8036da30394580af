"""Each iteration's time breakdown (``iterations[].timing`` of ``status --json``), from event
logs written by hand into a real run directory."""

import json
from pathlib import Path

from orchestrator.protocol import records
from orchestrator.cli.status import time_line
from orchestrator.data import summary
from orchestrator.ops import event_fold as timing
from orchestrator.ops import report, status
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.lease import Lease

A1, A2 = "a000001-aaaaaa", "a000002-bbbbbb"


def _run(tmp_path: Path, attempt: str = A2, iterations: int = 1) -> RunLayout:
    """A finished run's control files, ``iterations`` released, without event logs."""
    layout = RunLayout(tmp_path / "run")
    fsio.write_record(layout.lease, records.to_dict(Lease(2, attempt, "node0", 1, None, released=True)))
    fsio.write_record(layout.attempt(attempt).start, {"num_nodes": 2, "rl_phase": "both"})
    fsio.write_record(layout.progress, {"iteration": iterations, "phase": int(Phase.SYNC_END), "attempt": attempt})
    return layout


def _append(layout: RunLayout, attempt: str, rank: int, *events: dict) -> None:
    path = layout.attempt(attempt).events(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps({"rank": rank, "t": 1e9 + e.get("mono", 0.0), **e}, separators=(",", ":")) + "\n")


def _phases(iteration: int, starts: dict[int, float], released: float) -> list[dict]:
    """The master walks ``starts`` (phase -> mono at its start); the last phase is released at ``released``."""
    out = [{"event": "phase", "iteration": iteration, "phase": p, "mono": m} for p, m in starts.items()]
    last = max(starts)
    return out + [{"event": "released", "iteration": iteration, "phase": last, "mono": released}]


def _timing(iteration: int, phase: int, part: str, seconds: float, **fields) -> dict:
    return {"event": "timing", "iteration": iteration, "phase": phase, "part": part, "seconds": seconds, "mono": 0.0, **fields}


def test_timing_gives_the_master_phases_and_the_slowest_actor_per_part(tmp_path):
    layout = _run(tmp_path, A1, iterations=2)
    _append(layout, A1, 0, *_phases(1, {1: 10.0, 7: 11.0, 10: 11.5, 12: 14.0}, released=15.0),
            _timing(1, 10, "train.steps", 1.0, worker=0), _timing(1, 10, "train.total", 2.0))
    _append(layout, A1, 1,
            _timing(1, 10, "train.steps", 2.5, worker=1), _timing(1, 10, "train.checkpoint", 0.4, worker=1),
            _timing(1, 12, "engine.reload", 0.3, engine=0, pid=7), _timing(1, 12, "engine.reload", 0.7, engine=1, pid=8),
            # the same engine restarted in two phases of one iteration took both times
            _timing(1, 1, "engine.restart", 0.2, engine=0), _timing(1, 12, "engine.restart", 0.3, engine=0))
    for i in (1, 2):
        summary.update(layout, i, complete=i == 1)

    its = status.snapshot(layout.root)["iterations"]
    assert its[0]["timing"] == {
        "phases": {"1:rollout": 1.0, "7:engine_stop": 0.5, "10:train": 2.5, "12:engine_restart": 1.0},
        "total_s": 5.0,
        "parts": {"train.steps": 2.5, "train.checkpoint": 0.4, "train.total": 2.0, "engine.restart": 0.5, "engine.reload": 0.7},
    }
    assert list(its[0]["timing"]["parts"]) == ["train.steps", "train.checkpoint", "train.total", "engine.restart", "engine.reload"]
    assert its[1]["iteration"] == 2 and its[1]["timing"] is None  # no event of iteration 2


def test_a_later_attempt_replaces_the_figures_of_the_phases_it_redid(tmp_path):
    layout = _run(tmp_path)
    # attempt 1 did iteration 1's phases 7 and 10 (rank 1's trainer slow: 9 s), then died in phase 10
    _append(layout, A1, 0, {"event": "phase", "iteration": 1, "phase": 7, "mono": 0.0},
            {"event": "phase", "iteration": 1, "phase": 10, "mono": 2.0})
    _append(layout, A1, 1, _timing(1, 7, "engine.release", 0.8, engine=0), _timing(1, 10, "train.steps", 9.0, worker=1))
    # attempt 2 resumed at phase 10 and finished the iteration
    _append(layout, A2, 0, *_phases(1, {10: 100.0, 11: 103.0}, released=103.5), _timing(1, 10, "train.steps", 1.5, worker=0))
    _append(layout, A2, 1, _timing(1, 10, "train.steps", 2.0, worker=1))
    summary.update(layout, 1, complete=True)

    t = status.snapshot(layout.root)["iterations"][0]["timing"]
    assert t["phases"] == {"7:engine_stop": 2.0, "10:train": 3.0, "11:publish": 0.5}
    assert t["total_s"] == 5.5
    assert t["parts"] == {"engine.release": 0.8, "train.steps": 2.0}
    # report.json carries the same breakdown
    assert report.iteration_timing(report.event_logs(layout))[1] == t


def test_a_kept_reader_reads_only_what_the_logs_gained_and_waits_for_a_torn_line(tmp_path):
    layout = _run(tmp_path, A1)
    summary.update(layout, 1, complete=True)
    _append(layout, A1, 0, *_phases(1, {10: 0.0}, released=4.0))
    reader = timing.EventReader(layout)
    path = layout.attempt(A1).events(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(_timing(1, 10, "train.steps", 3.0, worker=1), separators=(",", ":")) + "\n"
    path.write_text(line[:20])  # the rank is still writing it
    assert status.snapshot(layout.root, reader)["iterations"][0]["timing"]["parts"] == {}
    with open(path, "a") as f:
        f.write(line[20:])
    _append(layout, A1, 1, _timing(1, 10, "train.checkpoint", 0.5, worker=1))
    assert status.snapshot(layout.root, reader)["iterations"][0]["timing"]["parts"] == {"train.steps": 3.0, "train.checkpoint": 0.5}
    # nothing new: the same figures, not counted twice
    assert status.snapshot(layout.root, reader)["iterations"][0]["timing"]["parts"] == {"train.steps": 3.0, "train.checkpoint": 0.5}


def test_eta_still_comes_from_the_master_phases_of_earlier_iterations(tmp_path):
    durations = {(1, int(Phase.TRAIN)): 4.0, (2, int(Phase.TRAIN)): 6.0, (1, int(Phase.PUBLISH)): 1.0}
    master = {"phase": "10:train", "iteration": 3, "in_phase_s": 2.0, "state": "working"}
    e = status.eta(durations, master, "both")
    assert (e["typical_s"], e["remaining_s"], e["iteration_remaining_s"]) == (5.0, 3.0, 4.0)


def test_status_line_names_the_slowest_phases_and_the_parts_of_training():
    t = {
        "phases": {"1:rollout": 1.2, "7:engine_stop": 0.05, "10:train": 3.1, "11:publish": 0.1, "12:engine_restart": 1.8,
                   "13:sync_end": 0.02},
        "total_s": 6.27,
        "parts": {"train.startup": 1.0, "train.steps": 1.6, "train.checkpoint": 0.4, "train.total": 3.0, "engine.reload": 0.3},
    }
    assert time_line(7, t) == ("last iteration 7 took 6.3s: train 3.1s (startup 1.0s, steps 1.6s, checkpoint 0.4s), "
                               "engine_restart 1.8s, rollout 1.2s, publish 0.1s, other 0.1s; engines (slowest): reload 0.3s")


def test_the_bytes_of_the_policy_written_and_read_come_with_the_timing(tmp_path):
    layout = _run(tmp_path, A1, iterations=1)
    _append(layout, A1, 0, *_phases(1, {1: 10.0, 10: 11.0, 12: 12.0}, released=13.0),
            _timing(1, 10, "train.checkpoint", 0.1, worker=0, bytes=600_000, bytes_state=400_000, bytes_delta=150_000),
            _timing(1, 10, "train.steps", 0.5, worker=0),
            _timing(1, 1, "engine.start", 3.0, engine=0, bytes=537_000), _timing(1, 12, "engine.reload", 0.01, engine=0, bytes=192_000))
    _append(layout, A1, 1, _timing(1, 1, "engine.start", 3.1, engine=1, bytes=537_000),
            _timing(1, 12, "engine.reload", 0.02, engine=1, bytes=192_000))
    summary.update(layout, 1, complete=True)
    timing_ = status.snapshot(layout.root)["iterations"][0]["timing"]
    assert timing_["bytes"] == {"written": 600_000, "read": 2 * (537_000 + 192_000), "written_weights": 200_000,
                                "written_deltas": 150_000, "written_state": 400_000, "read_per_node": {"0": 729_000, "1": 729_000}}
    assert time_line(1, timing_).endswith("; checkpoint 0.6 MB written (deltas 0.1 MB, training state 0.4 MB), 1.5 MB read by the engines")
