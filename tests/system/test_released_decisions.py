"""An iteration's decisions travel down in the releases that make them: phase 9's training
plan and phase 11's published checkpoint reach every rank in the barrier's release, a rank
reads ``checkpoints/current.json`` once when it enters an attempt and never again, and a
resume between phases 9 and 11 finds the plan in ``progress.json`` (no ``train_config.json``).
Real rank processes (rehearsal), counted by strace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import opcount
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from tests.harness import kill_tree, require, run_flags, wait_for

pytestmark = pytest.mark.timeout(240)

ITERATIONS = 3


def _start(rank: int, flags: list[str], log, *, trace=None, env: dict | None = None) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_FAULT"} | {"PYTHONUNBUFFERED": "1", **(env or {})}
    command = [sys.executable, "-m", "orchestrator", "run", *flags, "--master" if rank == 0 else f"--worker={rank}"]
    return subprocess.Popen([*(opcount.prefix(trace) if trace else []), *command], stdout=log, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True)


def _current_reads(trace_prefix, root) -> int:
    """How many times the traced process tree opened ``current.json`` to read it."""
    calls = [c for t in trace_prefix.parent.glob(f"{trace_prefix.name}.*") for c in opcount.parse(t, [str(root)])]
    return sum(1 for c in calls if c.name in ("open", "openat") and c.path.endswith("/checkpoints/current.json")
               and "O_CREAT" not in c.flags)


def test_each_rank_reads_the_current_pointer_once_and_takes_every_later_decision_from_the_releases(tmp_path):
    require(None if opcount.available() else "strace", "strace tests")
    log_path = tmp_path / "run"
    flags = run_flags(log_path, num_nodes=2, weights="1,1", max_iterations=ITERATIONS)
    procs = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.log", "wb") as log:
            procs.append(_start(rank, flags, log, trace=tmp_path / f"trace{rank}"))
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    for rank in (0, 1):
        reads = _current_reads(tmp_path / f"trace{rank}", log_path)
        print(f"rank {rank}: current.json read {reads} time(s) in {ITERATIONS} iterations")
        assert reads == 1, f"rank {rank} read current.json {reads} times in one attempt of {ITERATIONS} iterations"
    assert fsio.read_record(log_path / "checkpoints" / "current.json")["iteration"] == ITERATIONS
    assert not list(log_path.rglob("train_config.json"))


@pytest.mark.parametrize("phase", [Phase.TRAIN, Phase.PUBLISH], ids=lambda p: p.label)
def test_a_run_resumed_between_the_training_plan_and_its_publication_trains_as_planned(tmp_path, phase):
    log_path = tmp_path / "run"
    flags = run_flags(log_path, num_nodes=2, weights="1,1", max_iterations=ITERATIONS)
    with open(tmp_path / "held.log", "wb") as log:
        held = [_start(0, flags, log, env={"ORCHESTRATOR_FAULT": f"hold@2:{int(phase)}"}), _start(1, flags, log)]
    try:
        wait_for(lambda: b"fault injection: holding" in (tmp_path / "held.log").read_bytes(), 120, f"the master to hold at {phase.label}")
        progress = fsio.read_record(log_path / "control" / "progress.json")
        assert [p["iteration"] for p in progress["training"]] == [2], progress
    finally:
        for p in held:
            kill_tree(p.pid)
            p.wait(timeout=10)
    made = (log_path / "checkpoints" / "iter-000002").exists()
    assert made == (phase is Phase.PUBLISH), "held before training, or after it and before publishing"
    assert fsio.read_record(log_path / "checkpoints" / "current.json")["iteration"] == 1
    with open(tmp_path / "again.log", "wb") as log:
        again = [_start(r, flags, log) for r in (0, 1)]
    try:
        codes = [p.wait(timeout=120) for p in again]
    finally:
        for p in again:
            kill_tree(p.pid)
    assert codes == [0, 0], (tmp_path / "again.log").read_text()[-3000:]
    for iteration in range(1, ITERATIONS + 1):
        marker = fsio.read_record(log_path / "checkpoints" / f"iter-{iteration:06d}" / "marker.json")
        assert marker["records"] == 12, marker  # the plan's count of the sealed aggregate
    assert fsio.read_record(log_path / "control" / "progress.json")["training"] == [], "every plan published"
    assert not list(log_path.rglob("train_config.json"))
