"""The rollout keeps ``rollout.max_inflight`` sequences in flight on its engine, in requests
of ``rollout.prompts_per_request`` prompts, against a stub engine process that answers every request after a fixed
delay; a rank killed with kill -9 in the middle of such a rollout and started again leaves
every task exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import hold_after_first_batch, kill_tree, rl_flags, start_ranks, wait_for, wait_held_mid_rollout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TASKS, SAMPLES, IN_FLIGHT, PER_REQUEST = 96, 8, 64, 2
# One rank's train rollout against the stub engine, which the test started (--debug-mode).
ROLLOUT = dict(num_nodes=None, weights=None, rl_phase="rollout", max_iterations=1, settings=[
    "--rollout-split=train-only", "--debug-mode", f"rollout.max_inflight={IN_FLIGHT}", f"rollout.prompts_per_request={PER_REQUEST}",
    f"rl.train_tasks={TASKS}", f"rl.samples_per_prompt={SAMPLES}", "coordination.heartbeat_interval_s=0.5",
    "coordination.node_timeout_s=10"])


@pytest.fixture
def stub_engine(tmp_path):
    port_file = tmp_path / "stub.port"
    proc = subprocess.Popen([sys.executable, "-m", "tests.stub_engine", f"--port-file={port_file}", "--delay-s=0.3"],
                            start_new_session=True)
    try:
        port = int(wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 30, "the stub engine's port"))
        yield f"http://127.0.0.1:{port}"
    finally:
        kill_tree(proc.pid)


def _run(flags):
    return subprocess.run([sys.executable, "-m", "orchestrator", "run", *flags], capture_output=True, text=True, timeout=180)


def _task_ids(layout):
    return [json.loads(line)["task_id"] for line in layout.iteration(1).shard("train", 0).read_text().splitlines()]


def test_the_rollout_keeps_max_inflight_sequences_in_flight_in_requests_of_prompts_per_request(demo_data, tmp_path, stub_engine):
    layout = RunLayout(tmp_path / "run")
    result = _run(rl_flags(demo_data, layout.root, **ROLLOUT, extra=[f"rollout.engine_url={stub_engine}"]))
    assert result.returncode == 0, result.stderr[-4000:]
    stats = httpx.get(f"{stub_engine}/stats").json()
    assert stats["requests"] == TASKS // PER_REQUEST  # two prompts (their 8 samples each) a request
    assert stats["peak_sequences"] == IN_FLIGHT  # IN_FLIGHT / (8 x 2) requests at once: never fewer at the peak, never more
    ids = _task_ids(layout)
    assert len(ids) == TASKS and len(set(ids)) == TASKS


def test_a_rank_killed_mid_rollout_with_requests_in_flight_and_restarted_leaves_every_task_once(demo_data, tmp_path,
                                                                                                 stub_engine):
    layout = RunLayout(tmp_path / "run")
    flags = rl_flags(demo_data, layout.root, **ROLLOUT, extra=[f"rollout.engine_url={stub_engine}"])
    [proc] = start_ranks(flags, 1, env_for=hold_after_first_batch(0))
    try:
        wait_held_mid_rollout(layout, 0, timeout=60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        kept = _task_ids(layout)
        assert 0 < len(kept) < TASKS
    finally:
        kill_tree(proc.pid)
    result = _run(flags)
    assert result.returncode == 0, result.stderr[-4000:]
    ids = _task_ids(layout)
    assert len(ids) == TASKS and len(set(ids)) == TASKS
    assert ids[: len(kept)] == kept  # what was durable stays, first; only the rest was generated again
