"""The seeded fault soak (bench/chaos.py) in short: six rehearsal episodes, elastic off and on,
each a different fault at a random point of the run, recovered as the docs say. No rank may
hang, no task may be lost or done twice, and no process may be left behind."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
MUST_BE_ZERO = ("hangs", "tasks_lost", "tasks_duplicated", "tasks_extra", "orphans")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_six_seeded_fault_episodes_leave_no_hang_no_lost_or_duplicated_task_and_no_orphan(tmp_path):
    summary_file = tmp_path / "chaos.json"
    result = subprocess.run([sys.executable, str(CHAOS), "--episodes=6", "--seed=7", "--elastic=both", f"--out={tmp_path / 'out'}",
                             f"--json={summary_file}"], capture_output=True, text=True, timeout=400)
    print(result.stdout)
    assert summary_file.exists(), result.stdout[-6000:] + result.stderr[-3000:]
    totals = json.loads(summary_file.read_text())["totals"]
    assert {k: totals[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), result.stdout[-8000:]
    assert totals["episodes"] == 6
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
