"""Process-level faults of the matrix (issue 6): a rank frozen with SIGSTOP and continued
later, and a rank whose clock is an hour ahead. Each case: no process outlives its
deadline, a failure names rank, phase, iteration and cause, and re-running the same
commands completes the run with every task exactly once."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import NODE_TIMEOUT_S, assert_default_three_iteration_run, heartbeat, run_flags, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SKEW_SOURCE = Path(__file__).resolve().parents[1] / "clock_skew.c"


@pytest.fixture
def clock_skew_lib(tmp_path):
    """tests/clock_skew.c built into an LD_PRELOAD library (needs a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI=true but no C compiler to build tests/clock_skew.c", pytrace=False)
        pytest.skip("no C compiler to build tests/clock_skew.c")
    lib = tmp_path / "clock_skew.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(SKEW_SOURCE), "-ldl"], check=True, timeout=60)
    return lib


def test_a_frozen_rank_is_named_and_the_rerun_completes(cluster):
    flags = run_flags(cluster.log_path, extra=["rehearsal.work_s=0.5"])
    procs = cluster.start_all(flags)
    wait_for(lambda: (lambda hb: hb and hb.get("iteration") == 2 and hb.get("state") == "working")(heartbeat(cluster.layout, 1)),
             60, "rank 1 to work in iteration 2")
    os.kill(procs[1].pid, signal.SIGSTOP)  # alive, but silent: no heartbeat, no progress
    frozen = time.monotonic()
    try:
        codes = [procs[0].wait(timeout=NODE_TIMEOUT_S + 30), procs[2].wait(timeout=NODE_TIMEOUT_S + 30)]
        detected = time.monotonic() - frozen
        assert codes == [3, 3]
        said = procs[0].output()
        assert re.search(r"rank 1 on host \S+ died \(heartbeat stopped\) at iteration 2, phase \d+:\w+", said), said[-2000:]
        assert detected < NODE_TIMEOUT_S + 10
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    # Continued, it learns that its attempt ended without it and leaves, writing nothing that counts.
    assert procs[1].wait(timeout=NODE_TIMEOUT_S + 15) == 3
    print(f"frozen rank detected after {detected:.1f} s (node timeout {NODE_TIMEOUT_S:g} s)")
    rerun = cluster.start_all(flags)
    assert cluster.wait_all(rerun, timeout=90) == [0, 0, 0], rerun[0].output()[-3000:]
    assert_default_three_iteration_run(cluster.log_path)


def test_a_rank_an_hour_ahead_changes_nothing(cluster, clock_skew_lib):
    """Liveness and deadlines use each rank's own monotonic clock and heartbeat counters,
    never a comparison of two machines' clocks, so a skewed clock is harmless."""
    flags = run_flags(cluster.log_path)
    skewed = {"LD_PRELOAD": str(clock_skew_lib), "CLOCK_SKEW_S": "3600"}  # the wall clock only, as with bad NTP
    procs = cluster.start_all(flags, env_for={2: skewed})
    assert cluster.wait_all(procs, timeout=90) == [0, 0, 0], procs[2].output()[-3000:]
    assert_default_three_iteration_run(cluster.log_path)
    # The skew is real: rank 2's log lines carry its clock, an hour ahead of rank 0's.
    stamp = re.compile(r"^(\d\d):(\d\d):\d\d\.\d+ \[rank", re.M)
    h0, h2 = (int(stamp.search(p.output()).group(1)) for p in (procs[0], procs[2]))
    assert (h2 - h0) % 24 == 1
