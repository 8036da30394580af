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
