"""`orchestrator status` at 80 and 120 columns: columns are left out by priority, never cut;
every column has a header; the master's notes are shown. Rendered from a run directory whose
control files are written by hand (the values chosen long: hosts, pids, phases, counts)."""

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator import terminal
from orchestrator.protocol import records
from orchestrator.cli.status import ITERATION_COLUMNS, RANK_COLUMNS, RANK_COLUMNS_LEFT_OUT_FIRST, view
from orchestrator.data import summary
from orchestrator.ops import status
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.lease import Lease

A = "a000003-c0ffee"
KEY_COLUMNS = [c for c in RANK_COLUMNS if c not in RANK_COLUMNS_LEFT_OUT_FIRST]
NOTE = "rl.train_tasks=384 but /data/tasks/train.jsonl holds 200 tasks: each iteration samples all 200"


def _run(tmp_path: Path, *, notes: list[str] = ()) -> RunLayout:
    """A live 3-rank run in iteration 2: ranks 0 and 1 rolling out, rank 2 waiting at
    rollout_done; iteration 1 complete and evaluated."""
    layout = RunLayout(tmp_path / "run")
    attempt = layout.attempt(A)
    fsio.write_record(layout.lease, records.to_dict(Lease(3, A, "gpu-node-017.cluster.example", 1234567, None)))
    fsio.write_record(attempt.start, {"num_nodes": 3, "rl_phase": "both", "coordination": {"node_timeout_s": 600}})
    fsio.write_record(layout.progress, {"iteration": 1, "phase": int(Phase.SYNC_END), "attempt": A})
    beats = [("12:engine_restart", "working", {"done": 1024, "total": 2048, "rate": 123.456}),
             ("1:rollout", "working", {"done": 96, "total": 1024, "rate": 0.25}),
             ("2:rollout_done", "waiting", None)]
    for rank, (phase, state, progress) in enumerate(beats):
        fsio.write_record(attempt.heartbeat(rank), {
            "host": f"gpu-node-{17 + rank:03d}.cluster.example", "pid": 1234567 + rank, "rank": rank, "attempt": A,
            "counter": 40, "iteration": 2, "phase": phase, "state": state, "progress": progress, "in_phase_s": 754.2,
            "in_state_s": 1.0})
    summary.update(layout, 1, tasks_per_rank=[1024, 512, 512], tasks_done_per_rank=[1024, 640, 384],
                   tasks_taken_per_rank=[0, 0, 128], trajectories=16384, evaluated=True, metrics={"accuracy": 0.4375},
                   complete=True)
    summary.update(layout, 2, tasks_per_rank=[1024, 512, 512])
    if notes:
        fsio.write_record(attempt.notes, {"notes": list(notes)})
    return layout


def render(snap: dict, width: int) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, no_color=True, color_system=None, highlight=False, soft_wrap=True)
    console.print(view(snap))
    return buffer.getvalue()


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Each table drawn in ``text``: its header cells and its rows' cells."""
    found = []
    for block in re.findall(r"┏[^\n]*\n(.*?)└[^\n]*", text, re.S):
        lines = block.splitlines()
        header = [c.strip() for c in lines[0].strip("┃").split("┃")]
        rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in lines if ln.startswith("│")]
        found.append((header, rows))
    return found


@pytest.mark.parametrize("width", [80, 120])
def test_status_fits_the_width_cutting_no_header_and_no_value(tmp_path, width):
    snap = status.snapshot(_run(tmp_path).root)
    text = render(snap, width)
    assert "…" not in text, text
    assert all(len(line) <= width for line in text.splitlines()), text
    (rank_header, rank_rows), (it_header, it_rows) = tables(text)
    assert all(rank_header) and all(it_header), "every column has a header"
    assert set(rank_header) <= set(RANK_COLUMNS) and set(it_header) <= set(ITERATION_COLUMNS)
    assert [c for c in rank_header if c in KEY_COLUMNS] == KEY_COLUMNS, rank_header
    cells = [dict(zip(rank_header, row)) for row in rank_rows]
    assert [(c["rank"], c["alive"], c["state"], c["iter"], c["phase"], c["progress"], c["rate"]) for c in cells] == [
        ("0", "yes", "working", "2", "12:engine_restart", "1024/2048", "123/s"),
        ("1", "yes", "working", "2", "1:rollout", "96/1024", "0.25/s"),
        ("2", "yes", "waiting", "2", "2:rollout_done", "", ""),
    ]
    left_out = [c for c in RANK_COLUMNS if c not in rank_header and c != "note"]
    if left_out:
        assert f"(not shown at {width} columns: {', '.join(left_out)}; --json shows them)" in text.replace("\n", " ")
    its = [dict(zip(it_header, row)) for row in it_rows]
    assert [(i["iter"], i["trajectories"], i["accuracy"], i["complete"]) for i in its] == [("1", "16384", "0.438", "yes"),
                                                                                           ("2", "", "", "")]


def test_at_120_columns_only_the_least_wanted_columns_go(tmp_path):
    (rank_header, _), _ = tables(render(status.snapshot(_run(tmp_path).root), 120))
    assert rank_header == ["rank", "alive", "state", "iter", "phase", "for", "progress", "rate", "heartbeat"]
    (rank_header, _), (it_header, _) = tables(render(status.snapshot(_run(tmp_path).root), 200))
    assert rank_header == ["rank", "host", "pid", "alive", "state", "iter", "phase", "for", "progress", "rate", "heartbeat"]
    assert it_header == ITERATION_COLUMNS


def test_a_rank_the_barrier_waits_for_is_marked_in_the_note_column(tmp_path):
    layout = _run(tmp_path)
    attempt = layout.attempt(A)
    for r in (1, 2):  # ranks 1 and 2 arrived at rollout_done; rank 0 is still rolling out
        fsio.write_record(attempt.arrive(r), {"attempt": A, "iteration": 2, "phase": int(Phase.ROLLOUT_DONE), "payload": {}})
    text = render(status.snapshot(layout.root), 200)
    (header, rows), _ = tables(text)
    assert header[-1] == "note" and rows[0][-1] == "<- barrier waits" and rows[1][-1] == rows[2][-1] == ""
    assert "barrier 2:rollout_done of iteration 2: 2 arrived, waits for rank 0" in text


def test_too_narrow_for_the_key_columns_each_rank_is_one_line(tmp_path):
    text = render(status.snapshot(_run(tmp_path).root), 50)
    assert "┏" not in text and "…" not in text
    assert "rank 0: host gpu-node-017.cluster.example, pid 1234567, alive yes, state working" in text.replace("\n", " ")


def test_status_shows_the_masters_notes_under_the_run_line(tmp_path):
    snap = status.snapshot(_run(tmp_path, notes=[NOTE]).root)
    assert snap["notes"] == [NOTE]
    assert render(snap, 200).splitlines()[1] == f"note: {NOTE}"
    assert f"note: {NOTE}" in render(snap, 80).replace("\n", " ")  # folded at a space, not cut


def test_a_run_without_notes_has_none(tmp_path):
    snap = status.snapshot(_run(tmp_path).root)
    assert snap["notes"] == [] and "note:" not in render(snap, 200)


def test_fit_columns_leaves_out_the_optional_columns_in_order_until_the_table_fits():
    widths = [4, 10, 6, 9]  # a table of all four takes 29 + 3 * 4 + 1 = 42 cells
    assert terminal.table_width(widths) == 42
    assert terminal.fit_columns(widths, [1, 3], 42) == [0, 1, 2, 3]
    assert terminal.fit_columns(widths, [1, 3], 41) == [0, 2, 3]  # 29 cells
    assert terminal.fit_columns(widths, [1, 3], 28) == [0, 2]  # 17 cells
    assert terminal.fit_columns(widths, [1, 3], 16) is None
