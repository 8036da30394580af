"""`orchestrator stop` on a run that has finished: nothing to stop is not an error (exit 0)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(90)


def _orchestrator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "NODE_RANK", "SLURM_PROCID",
                                                                                    "SLURM_NTASKS")}, "NO_COLOR": "1"})


def test_stop_on_a_finished_run_says_so_and_exits_0(tmp_path):
    run = _orchestrator("run", f"--data-path={tmp_path / 'data'}", f"--log-path={tmp_path / 'run'}", "--rehearsal",
                        "--rl-phase=both", "--eval-interval=2", "--max-iterations=1")
    assert run.returncode == 0, run.stderr
    stop = _orchestrator("stop", f"--log-path={tmp_path / 'run'}")
    assert stop.returncode == 0, stop.stderr
    assert stop.stdout.strip() == f"the run under {tmp_path / 'run'} has finished (iteration 1, phase 13:sync_end): nothing to stop"
    assert not list((tmp_path / "run" / "attempts").glob("*/stop.json")), "nothing is asked of a finished run"


def test_a_finished_run_rerun_with_a_changed_setting_says_it_is_not_applied_and_how_to_go_on(tmp_path):
    flags = [f"--data-path={tmp_path / 'data'}", f"--log-path={tmp_path / 'run'}", "--rehearsal", "--rl-phase=both", "--eval-interval=2",
             "--max-iterations=1", "coordination.heartbeat_interval_s=0.5"]
    assert _orchestrator("run", *flags).returncode == 0
    again = _orchestrator("run", *flags)
    assert again.returncode == 0 and "nothing is left to do; raise --max-iterations to go on" in again.stderr, again.stderr
    changed = _orchestrator("run", *flags, "rehearsal.work_s=0.5")
    text = " ".join(changed.stderr.split())
    assert changed.returncode == 0, changed.stderr
    assert "rehearsal.work_s=0.5 (the run used " in text and "is not applied: nothing is left to train" in text, text
    assert "Raise --max-iterations to go on (the iterations after 1 take the new value)" in text, text
