"""`orchestrator status` during a rollout: each rank's progress (done/total) and rate (tasks/s)
appear from its first durable batch, also at 80 columns; a run on fewer tasks than it asks
for says so once in the master's log and in status."""

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from orchestrator.cli.status import view
from orchestrator.ops import status
from orchestrator.phase_table import Phase
from tests.harness import hold_after_first_batch, run_flags, status_json, wait_for, wait_held_mid_rollout

pytestmark = pytest.mark.timeout(150)


def _shown(log_path, columns: int) -> str:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, "NO_COLOR": "1", "COLUMNS": str(columns)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def _rank_rows(text: str) -> dict[int, dict[str, str]]:
    """The ranks table's rows by rank, each cell under its header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┃ rank "))
    names = [c.strip() for c in lines[start].strip("┃").split("┃")]
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    rows = [dict(zip(names, (c.strip() for c in line.strip("│").split("│")))) for line in lines[start:end] if line.startswith("│")]
    return {int(r["rank"]): r for r in rows}


@pytest.mark.slow
def test_progress_and_rate_show_during_a_rehearsal_rollout_from_the_first_durable_batch(cluster):
    # 12 tasks a rank at 0.4 s each: a rollout of about 5 s, one task per durable batch.
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1", max_iterations=1,
                      extra=["rehearsal.tasks=24", "rehearsal.task_s=0.4", "coordination.heartbeat_interval_s=0.5",
                             "coordination.node_timeout_s=5"])
    procs = cluster.start_all(flags, n=2)

    def rolling_out():
        if not cluster.layout.lease.exists():
            return None
        snap = status_json(cluster.log_path)
        ranks = snap["ranks"]
        if all(r["phase"] == Phase.ROLLOUT.label and r["progress"] and 0 < r["progress"]["done"] < r["progress"]["total"]
               and r["rate"] for r in ranks):
            return snap
        return None

    snap = wait_for(rolling_out, 40, "both ranks to show progress and a rate part-way through the rollout", interval=0.2)
    for r in snap["ranks"]:
        assert r["progress"]["total"] == 12 and r["state"] == "working"
        assert 0.5 < r["rate"] < 5, r  # about 2.5 tasks/s: 1 / 0.4 s, less the fsyncs

    text = _shown(cluster.log_path, 80)
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines()), text
    rows = _rank_rows(text)
    assert sorted(rows) == [0, 1], text
    for r in rows.values():
        done, total = r["progress"].split("/")
        assert total == "12" and int(done) > 0 and r["rate"].endswith("/s") and r["phase"] == "1:rollout", text

    # the same snapshot drawn at 80 and 120 columns cuts nothing
    snap = status.snapshot(cluster.log_path)
    for width in (80, 120):
        buffer = io.StringIO()
        Console(file=buffer, width=width, no_color=True, highlight=False, soft_wrap=True).print(view(snap))
        assert "…" not in buffer.getvalue(), buffer.getvalue()
    assert cluster.wait_all(procs, timeout=60) == [0, 0], "\n".join(p.output() for p in procs)
    assert all(r["progress"] is None and r["rate"] is None for r in status_json(cluster.log_path)["ranks"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_rl_rank_held_after_its_first_batch_shows_its_progress_and_rate_and_the_run_notes_its_short_task_file(
        demo_data, cluster, tmp_path):
    train = tmp_path / "train96.jsonl"
    train.write_text("".join((demo_data / "tasks" / "train.jsonl").read_text().splitlines(keepends=True)[:96]))
    flags = [f"--data-path={demo_data}", f"--log-path={cluster.log_path}", "--rl-phase=both", "--eval-interval=5",
             "--num-nodes=2", "--rank-weights=1,1", "--max-iterations=1", f"data.train_file={train}", "rl.train_tasks=128", "rollout.max_inflight=32", "rollout.prompts_per_request=4",
             "rl.samples_per_prompt=2", "rl.eval_tasks=8", "rl.eval_samples=1", "rl.epochs=1", "rl.micro_batch=4",
             "coordination.heartbeat_interval_s=0.5", "coordination.node_timeout_s=10", "coordination.join_timeout_s=60",
             "coordination.work_stealing=false"]  # rank 1 rolls out its own share, however slow its engine start
    procs = cluster.start_all(flags, n=2, env_for=hold_after_first_batch(1))
    wait_held_mid_rollout(cluster.layout, 1, timeout=150)

    held = wait_for(lambda: (lambda s: s if s["ranks"][1]["rate"] else None)(status_json(cluster.log_path)), 10,
                    "rank 1's rate")["ranks"][1]
    assert held["phase"] == "1:rollout" and held["state"] == "held" and held["progress"]["done"] >= 16, held
    note = f"rl.train_tasks=128 but {train} holds 96 tasks: each iteration samples all 96"
    assert status_json(cluster.log_path)["notes"] == [note]
    text = _shown(cluster.log_path, 80)
    assert "".join(f"note: {note}".split()) in "".join(text.split()), text  # wrapped at 80 columns, a long path mid-word
    row = _rank_rows(text)[1]
    assert row["progress"] == f"{held['progress']['done']}/{held['progress']['total']}" and row["rate"].endswith("/s"), text

    cluster.kill_all()
    for p in procs:
        p.wait(timeout=30)
    master_log = procs[0].output()
    assert master_log.count(note) == 1, master_log[-4000:]
    assert note not in procs[1].output()
    assert json.loads(json.dumps(status_json(cluster.log_path)))["notes"] == [note]
