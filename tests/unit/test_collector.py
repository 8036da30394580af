"""The collector's tuning (orchestrator/node/collector.py): made by each process's entry point, never
by an import, so that a program importing the package keeps its own settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchestrator.node import collector

_REPORT = "import atexit, gc, sys\natexit.register(lambda: sys.stderr.write(f'young={gc.get_threshold()[0]}\\n'))\n"
"""A sitecustomize that says, as the process ends, what its youngest generation's threshold is."""


def _young_at_exit(args: list[str], tmp_path) -> int:
    (tmp_path / "sitecustomize.py").write_text(_REPORT)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)
    return int(out.stderr.rsplit("young=", 1)[1].split()[0])


@pytest.mark.parametrize("entry", [["-m", "orchestrator"], ["-m", "orchestrator.engine.server"], ["-m", "orchestrator.train.worker"],
                                   ["-c", "from orchestrator.cli import main; main()"]],  # the `orchestrator` script's entry
                         ids=["orchestrator", "engine", "trainer", "script"])
def test_each_entry_point_makes_the_young_generation_larger(entry, tmp_path):
    assert _young_at_exit([*entry, "--help"], tmp_path) == collector.YOUNG > 700


def test_importing_the_entry_modules_leaves_the_collector_as_it_was(tmp_path):
    code = "import orchestrator.engine.server, orchestrator.train.worker, orchestrator.cli"
    assert _young_at_exit(["-c", code], tmp_path) == 700  # CPython's default
