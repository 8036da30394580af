"""A rank's children (engine, trainer) die with it, even on kill -9, which runs no cleanup;
and the rank stops a child's whole process group."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(60)

# A stand-in rank: threads running (as a rank's heartbeat and monitor do), one child that
# itself starts a grandchild in its group, the pids printed.
RANK = """
import subprocess, sys, threading, time
from orchestrator.node.procs import Children
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
children = Children()
child = children.start([sys.executable, "-c", "import subprocess, sys, time; "
                        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                        "print(g.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
print(child.pid, grandchild, flush=True)
if sys.argv[1] == "stop":
    children.stop(child, grace_s=2)
    print("stopped", flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not _gone(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def _start_rank(mode: str):
    rank = subprocess.Popen([sys.executable, "-c", RANK, mode], stdout=subprocess.PIPE, text=True)
    child, grandchild = map(int, rank.stdout.readline().split())
    return rank, child, grandchild


def test_kill_9_of_the_rank_takes_its_child_down():
    rank, child, grandchild = _start_rank("hold")
    try:
        assert "time.sleep(120)" in " ".join(psutil.Process(child).cmdline()), "the child runs its own program, not a wrapper"
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=10)
        assert _wait_gone([child], within_s=10) == [], "the child outlived its rank's kill -9"
    finally:
        for pid in (child, grandchild):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_stop_ends_the_childs_whole_process_group():
    rank, child, grandchild = _start_rank("stop")
    try:
        assert rank.stdout.readline().strip() == "stopped"
        assert _wait_gone([child, grandchild], within_s=10) == []
    finally:
        rank.kill()
        rank.wait(timeout=10)
        for pid in (child, grandchild):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_program_that_does_not_exist_is_refused_at_start():
    from orchestrator.node.procs import Children

    with pytest.raises(FileNotFoundError, match="no-such-program"):
        Children().start(["no-such-program-xyz"])
