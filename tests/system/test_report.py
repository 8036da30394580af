"""`orchestrator report`: charts, report.json and the HTML page of a real run, checked
against the run's own files (metrics.jsonl, aggregates, summaries, event logs)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.data import shards
from orchestrator.ops import report, report_html
from orchestrator.ops.event_fold import rank_segments
from orchestrator.ops.iteration_rows import train_reward
from orchestrator.phase_table import PHASE_TABLE, Barrier, Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.events import read_events
from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, run_flags

pytestmark = pytest.mark.timeout(120)

FAST = [
    "coordination.heartbeat_interval_s=0.25",
    "coordination.node_timeout_s=3",
    "coordination.join_timeout_s=20",
    "rehearsal.work_s=0.05",
]
PNGS = (report.CURVES_PNG, report.TIMELINE_PNG, report.BARRIER_WAIT_PNG, report.BREAKDOWN_PNG)


def _local(data: Path, log_path: Path, max_iterations: int) -> None:
    flags = ["--num-nodes=3", "--rank-weights=2,1,1", "--rehearsal", "--rl-phase=both", "--eval-interval=1",
             f"--max-iterations={max_iterations}", f"--data-path={data}", f"--log-path={log_path}", *FAST]
    out = subprocess.run([sys.executable, "-m", "orchestrator", "local", *flags], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "report", *args], capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-rank rehearsal of 3 iterations in two attempts (2 iterations, then resumed to 3),
    and its report in the default place."""
    tmp = tmp_path_factory.mktemp("report")
    log_path = tmp / "run"
    _local(tmp, log_path, 2)
    _local(tmp, log_path, 3)
    out = _report(f"--log-path={log_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 iteration(s), 3 rank(s), 2 attempt(s)" in out.stdout
    out_dir = log_path / "report"
    return log_path, out_dir, json.loads((out_dir / "report.json").read_text())


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _events(log_path: Path) -> dict[str, dict[int, list[dict]]]:
    """attempt -> rank -> events, read independently of the report."""
    out = {}
    for events_dir in sorted((log_path / "attempts").glob("*/events")):
        out[events_dir.parent.name] = {int(p.stem[1:]): read_events(p) for p in sorted(events_dir.glob("r*.jsonl"))}
    return out


# -- the files -------------------------------------------------------------------------------


def test_report_writes_four_png_charts_report_json_and_a_static_page_referencing_them(run):
    log_path, out_dir, data = run
    for name in PNGS:
        path = out_dir / name
        width, height = _png_size(path)
        assert 400 <= width <= 2000 and 200 <= height <= 2000, (name, width, height)
        assert 5_000 < path.stat().st_size < 300_000, (name, path.stat().st_size)
    page = (out_dir / "index.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert sorted(re.findall(r'<img src="([^"]+)"', page)) == sorted(PNGS)
    assert 'href="report.json"' in page
    assert "<script" not in page.lower()
    # the first table: one row per iteration, with its eval accuracy
    rows = re.findall(r"<tr><td>(\d+)</td>(.*?)</tr>", page.split("</table>")[0])
    assert [int(i) for i, _ in rows] == [1, 2, 3]
    for (i, cells), line in zip(rows, _metrics_lines(log_path)):
        assert f"<td>{line['accuracy']:.3f}</td>" in cells
    assert data["charts"] == {"curves": "curves.png", "timeline": "timeline.png", "barrier_wait": "barrier_wait.png",
                              "breakdown": "breakdown.png"}
    assert not list(out_dir.glob(".*.tmp")), "temp files left behind"


def test_out_option_writes_elsewhere_and_leaves_the_default_alone(run, tmp_path):
    log_path, out_dir, _ = run
    before = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    out = _report(f"--log-path={log_path}", f"--out={tmp_path / 'elsewhere'}")
    assert out.returncode == 0, out.stderr
    assert {p.name for p in (tmp_path / "elsewhere").iterdir()} == {*PNGS, "report.json", "index.html"}
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == before


# -- the numbers -----------------------------------------------------------------------------


def _metrics_lines(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_eval_curve_is_metrics_jsonl(run):
    log_path, _, data = run
    lines = _metrics_lines(log_path)
    assert [m["iteration"] for m in lines] == [1, 2, 3]
    assert data["eval"] == lines
    assert [r["eval_accuracy"] for r in data["iterations"]] == [m["accuracy"] for m in lines]
    assert [r["eval_mean_reward"] for r in data["iterations"]] == [m["mean_reward"] for m in lines]


def test_train_reward_and_counts_match_the_aggregates_and_summaries(run):
    log_path, _, data = run
    layout = RunLayout(log_path)
    for i, row in zip((1, 2, 3), data["iterations"]):
        rewards = [r["reward"] for r in aggregate_records(layout, i)]
        assert row["iteration"] == i
        assert row["train_mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
        s = fsio.read_record(layout.iteration(i).summary)
        assert row["tasks_per_rank"] == s["tasks_per_rank"] == [12, 6, 6]
        assert row["trajectories"] == s["trajectories"] == len(rewards)
        assert row["complete"] is True and row["evaluated"] is True
        assert row["master_s"] > 0
    assert [t["iteration"] for t in data["train"]] == [1, 2, 3]
    assert [t["mean_reward"] for t in data["train"]] == [r["train_mean_reward"] for r in data["iterations"]]


def test_timeline_has_one_work_bar_per_phase_walked_and_one_wait_per_arrival(run):
    log_path, _, data = run
    events = _events(log_path)
    tl = data["timeline"]
    assert [a["attempt"] for a in tl["attempts"]] == sorted(events) and len(events) == 2  # a000001-..., a000002-...
    first, second = tl["attempts"]
    assert first["end_s"] <= second["start_s"]
    assert min(s["start_s"] for s in tl["segments"]) == 0.0
    segs = tl["segments"]
    for attempt, by_rank in events.items():
        for rank, evs in by_rank.items():
            mine = [s for s in segs if s["attempt"] == attempt and s["rank"] == rank]
            phases = [(e["iteration"], e["phase"]) for e in evs if e["event"] == "phase"]
            assert [(s["iteration"], s["phase"]) for s in mine if s["kind"] == "work"] == phases
            arrivals = [(e["iteration"], e["phase"]) for e in evs if e["event"] == "arrive"]
            assert [(s["iteration"], s["phase"]) for s in mine if s["kind"] == "wait"] == arrivals
            decided = [(e["iteration"], e["phase"]) for e in evs if e["event"] == "all_arrived"]
            assert [(s["iteration"], s["phase"]) for s in mine if s["kind"] == "decide"] == decided
            assert bool(decided) == (rank == 0)
            starts = [s["start_s"] for s in mine]
            assert starts == sorted(starts)
    # every rank walked the 14 phases of 3 iterations exactly once, over both attempts
    for rank in (0, 1, 2):
        work = [(s["iteration"], s["phase"]) for s in segs if s["rank"] == rank and s["kind"] == "work"]
        assert work == [(i, p) for i in (1, 2, 3) for p in range(14)]
        # the first attempt did iterations 1-2, the resumed one iteration 3
        assert {s["iteration"] for s in segs if s["rank"] == rank and s["attempt"] == second["attempt"]} == {3}
    assert all(s["complete"] and s["seconds"] >= 0 and s["end_s"] >= s["start_s"] for s in segs)
    assert all(s["label"] == Phase(s["phase"]).label for s in segs)


def test_barrier_waits_per_phase_and_rank_match_the_event_logs(run):
    log_path, _, data = run
    expected: dict[tuple[int, int], list[float]] = {}
    for by_rank in _events(log_path).values():
        for rank, evs in by_rank.items():
            # a worker waits from its arrival to the release; the master until the last arrival
            end_event = "all_arrived" if rank == 0 else "released"
            arrived = {}
            for e in evs:
                key = (e.get("iteration"), e.get("phase"))
                if e["event"] == "arrive":
                    arrived[key] = e["mono"]
                elif e["event"] == end_event:
                    expected.setdefault((e["phase"], rank), []).append(e["mono"] - arrived.pop(key))
    got = {(w["phase"], w["rank"]): w for w in data["barrier_wait"]}
    assert set(got) == set(expected)
    barrier_phases = {int(p) for p in Phase if PHASE_TABLE[p].barrier is Barrier.ALL}
    assert {p for p, _ in got} == barrier_phases
    for key, waits in expected.items():
        w = got[key]
        assert w["count"] == len(waits) == 3  # one per iteration
        assert w["total_s"] == pytest.approx(sum(waits), abs=1e-9)
        assert w["max_s"] == pytest.approx(max(waits), abs=1e-9)
        assert w["mean_s"] == pytest.approx(sum(waits) / 3, abs=1e-9)
        assert min(waits) >= 0 and w["label"] == Phase(key[0]).label


def test_time_breakdown_has_every_phase_the_master_walked_back_to_back_in_the_attempt_that_ran_it(run):
    log_path, out_dir, data = run
    events = _events(log_path)
    for row in data["iterations"]:
        t = row["timing"]
        assert set(t["phases"]) == {p.label for p in Phase}  # report.json sorts its keys
        assert t["total_s"] == pytest.approx(sum(t["phases"].values()), abs=0.01)
        # attempt 1 ran iterations 1 and 2, attempt 2 iteration 3
        master = events[sorted(events)[0 if row["iteration"] < 3 else 1]][0]
        mine = [e for e in master if e.get("iteration") == row["iteration"]]
        first = next(e for e in mine if e["event"] == "phase")
        last = [e for e in mine if e["event"] == "released"][-1]
        assert t["total_s"] == pytest.approx(last["mono"] - first["mono"], abs=0.01)
        # the timeline's rank 0 segments leave out only the gaps between a release and the next phase
        assert row["master_s"] <= t["total_s"] + 0.01 and t["total_s"] - row["master_s"] < 0.5
        assert t["parts"] == {}  # a rehearsal records no train or engine parts
    page = (out_dir / "index.html").read_text()
    table = page.split("<caption>seconds per phase (master)</caption>")[1].split("</table>")[0]
    assert [int(i) for i in re.findall(r"<th>(\d+)</th>", table)] == [1, 2, 3]  # iterations across, phases down
    assert re.findall(r"<tr><th>([^<]+)</th>", table) == ["iteration", "total", *(p.label for p in Phase)]
    assert "<caption>slowest" not in page  # no table of parts


def test_report_of_a_failed_run_ends_each_rank_where_it_stopped(cluster):
    eval_phase = int(Phase.EVAL)
    procs = cluster.start_all(run_flags(cluster.log_path), env_for={1: {"ORCHESTRATOR_FAULT": f"raise@1:{eval_phase}"}})
    assert cluster.wait_all(procs, timeout=60) == [3, 1, 3], "\n".join(p.output() for p in procs)
    out = _report(f"--log-path={cluster.log_path}", f"--out={cluster.tmp / 'rep'}")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((cluster.tmp / "rep" / "report.json").read_text())
    segs = data["timeline"]["segments"]
    last = {r: [s for s in segs if s["rank"] == r][-1] for r in (0, 1, 2)}
    # rank 1 failed in eval's work; the master was told in eval (it released eval_decide
    # before rank 1 could enter eval), rank 2 in eval or still polling eval_decide's release
    assert (last[1]["kind"], last[1]["iteration"], last[1]["phase"], last[1]["complete"]) == ("work", 1, eval_phase, False)
    assert (last[0]["iteration"], last[0]["phase"], last[0]["complete"]) == (1, eval_phase, False)
    assert (last[2]["iteration"], last[2]["complete"]) == (1, False) and last[2]["phase"] in (eval_phase - 1, eval_phase)
    assert all(s["complete"] for s in segs if s not in last.values())
    assert [r["iteration"] for r in data["iterations"]] == [1]
    assert data["eval"] == [] and data["iterations"][0]["eval_accuracy"] is None
    assert data["iterations"][0]["complete"] is False
    for name in PNGS:
        _png_size(cluster.tmp / "rep" / name)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda tmp: Path("relative/run"), "--log-path must be absolute"),
    (lambda tmp: tmp / "missing", "is not a directory"),
    (lambda tmp: tmp, "holds no run data"),
])
def test_bad_log_path_exits_2_and_writes_nothing(tmp_path, make, message):
    out = _report(f"--log-path={make(tmp_path)}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert list(tmp_path.iterdir()) == []


# -- the extraction, on made-up logs ---------------------------------------------------------


def _ev(event: str, t: float, mono: float | None = None, **fields) -> dict:
    return {"event": event, "rank": 1, "t": t, "mono": t + 1000 if mono is None else mono, **fields}


def test_rank_segments_close_a_barrierless_phase_at_the_next_phase_and_keep_open_ones_incomplete():
    events = [
        _ev("phase", 10.0, iteration=1, phase=1),   # rollout: no barrier
        _ev("phase", 12.0, iteration=1, phase=2),
        _ev("arrive", 12.5, iteration=1, phase=2),
        _ev("released", 13.0, iteration=1, phase=2),
        _ev("phase", 13.0, iteration=1, phase=3),
        _ev("end", 14.0, state="failed"),            # failed in phase 3's work
    ]
    segs = rank_segments(events)
    assert [(s["kind"], s["phase"], s["seconds"], s["complete"]) for s in segs] == [
        ("work", 1, 2.0, True), ("work", 2, 0.5, True), ("wait", 2, 0.5, True), ("work", 3, 1.0, False),
    ]
    # a log cut short (kill -9: no end event) leaves its last segment open at the last event
    segs = rank_segments(events[:3])
    assert segs[-1]["kind"] == "wait" and segs[-1]["complete"] is False and segs[-1]["seconds"] == 0.0


def test_rank_segments_fall_back_to_wall_time_when_the_monotonic_clock_goes_back():
    events = [_ev("phase", 5.0, mono=100.0, iteration=1, phase=0), _ev("arrive", 7.0, mono=3.0, iteration=1, phase=0),
              _ev("released", 7.5, mono=3.25, iteration=1, phase=0)]
    assert [s["seconds"] for s in rank_segments(events)] == [2.0, 0.25]


def test_train_reward_averages_every_sample_of_a_sealed_rl_aggregate(tmp_path):
    path = tmp_path / "train.jsonl"
    with shards.ShardWriter(path) as w:
        w.append({"task_id": "a", "samples": [{"reward": 1.0}, {"reward": 0.0}, {"reward": 0.5}]})
        w.append({"task_id": "b", "samples": [{"reward": 1.0}]})
    assert train_reward(path) is None  # not sealed yet
    shards.seal(path)
    assert train_reward(path) == {"mean_reward": 2.5 / 4, "records": 2, "samples": 4}


def test_breakdown_chart_and_tables_show_the_train_and_engine_parts():
    rows = [{"iteration": i, "timing": {
        "phases": {"1:rollout": 1.0, "10:train": 3.0 + i, "12:engine_restart": 1.5},
        "total_s": 5.5 + i,
        "parts": {"engine.reload": 1.2, "train.startup": 0.5, "train.steps": 1.0 + i, "train.checkpoint": 0.3, "train.total": 2.5 + i},
    }} for i in (1, 2)] + [{"iteration": 3, "timing": None}]
    width, height = struct.unpack(">II", report.breakdown_png({"iterations": rows})[16:24])
    assert 400 <= width <= 2000 and 200 <= height <= 2000
    tables = report_html.time_tables(rows)
    assert tables.count("<table") == 2
    parts = tables.split("</table>")[1]
    assert re.findall(r"<tr><th>([^<]+)</th>", parts) == ["iteration", "train.startup", "train.steps", "train.checkpoint",
                                                         "train.total", "engine.reload"]
    assert "<tr><th>iteration</th><th>1</th><th>2</th></tr>" in parts, "iteration 3 has no timing: no column"
    assert "<tr><th>train.steps</th><td>2.000</td><td>3.000</td></tr>" in parts


def test_the_time_tables_stay_narrow_whatever_the_iterations_and_show_bytes_in_units():
    """14 phases and 40 iterations: a row never holds more than the last 12 iterations and a
    label (the page at 1280 px once ran off at the 10th phase); bytes read 1.6 MB, not 1618098."""
    phases = {p.label: 1.0 for p in Phase}
    rows = [{"iteration": i, "timing": {"phases": phases, "total_s": 14.0, "parts": {"train.total": 2.0},
                                        "bytes": {"written": 1618098, "read": 3_200_000_000}}} for i in range(1, 41)]
    tables = report_html.time_tables(rows)
    for table in tables.split("</table>")[:-1]:
        for row in re.findall(r"<tr>(.*?)</tr>", table):
            assert len(re.findall(r"<t[hd]>", row)) <= report_html.TIME_TABLE_ITERATIONS + 1, row
    assert "the last 12 of 40 iterations" in tables and "<th>29</th>" in tables and "<th>28</th>" not in tables
    assert "<td>1.6 MB</td><td>3.2 GB</td>" in tables and "1618098" not in tables
