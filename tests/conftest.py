import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faultfs_fixtures import faultfs_mounts  # noqa: F401 - a fixture for the fault-injecting filesystem
from tests.harness import Cluster, require
from tests.sshfs import SshfsMounts, missing_prerequisites

# Where PYTHONDONTWRITEBYTECODE is set (some sandboxes and CI images set it) Python caches no
# bytecode, so each of the hundreds of processes the suite starts (ranks, engines, trainers,
# `status`) compiles again every orchestrator module it imports: 0.1 s of CPU a rank. The
# processes the tests start write and reuse __pycache__ (git ignores it), as on a developer's machine.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp=tmp_path, log_path=tmp_path / "run")
    yield c
    c.kill_all()


@pytest.fixture
def sshfs_mounts(tmp_path):
    """A factory: ``export, mounts = sshfs_mounts(n)`` gives n sshfs clients of one directory.

    Each mount has its own client cache (default sshfs options). Everything is unmounted at
    teardown, also when the test fails. Skipped where sshfs is not installed, except on CI
    (CI=true), which installs it with scripts/setup-dev.sh and must not skip silently.
    """
    require(missing_prerequisites(), "sshfs tests")
    mounts = SshfsMounts(export=tmp_path / "export", base=tmp_path / "mnt")
    try:
        def make(n: int):
            return mounts.export, mounts.mount(n)

        yield make
    finally:
        mounts.close()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """Demo data with a briefly warmed-up model (100 steps): shared by the RL tests."""
    path = tmp_path_factory.mktemp("demo") / "data"
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}", "--warm-steps=100"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    return path


@pytest.fixture(scope="session")
def chat_demo_data(tmp_path_factory):
    """The chat demo (`demo-data --chat`, seed 0) with a briefly warmed-up model (40 steps:
    it answers in the format, mostly wrongly)."""
    path = tmp_path_factory.mktemp("chat-demo") / "data"
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", "--chat", f"--data-path={path}", "--warm-steps=40"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert json.loads((path / "demo.json").read_text())["run_keys"] == {"rl.reward": "orchestrator.rewards:math"}, \
        "demo-data --chat names the reward its runs need"
    return path


@dataclass(frozen=True)
class Made:
    path: Path
    seconds: float  # how long `demo-data` took, wall clock


@pytest.fixture(scope="session")
def readme_demo_data(tmp_path_factory) -> Made:
    """The README's demo data as its main job makes it: `demo-data --data-path` with the
    product's defaults (seed 0, warm start to the band), this CPU's kernels. Made once for the
    session: the README main job's seed-0 test and the two-rank FSDP run both start from it
    (runs read --data-path and write nothing there)."""
    path = tmp_path_factory.mktemp("readme-demo") / "data"
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return Made(path, time.monotonic() - started)
