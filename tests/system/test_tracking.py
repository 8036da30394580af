"""Experiment tracking end to end: a real run logs every iteration to tensorboard, wandb
(offline) and mlflow (a file store), read back with each backend's own reader; killed with
kill -9 after logging and resumed, every step is in each backend exactly once. A backend that
fails leaves one warning and a line in `status`; the run goes on."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from tests.harness import kill_tree, rl_flags, start_ranks, status_json, wait_for, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

SMALL = ["rl.train_tasks=8", "rl.samples_per_prompt=4", "rl.eval_tasks=16", "rl.eval_samples=2", "rl.epochs=1",
         "coordination.heartbeat_interval_s=0.25", "coordination.node_timeout_s=5"]
EXPECTED = {"reward/mean", "eval/accuracy", "eval/pass_at_2", "train/loss", "train/entropy", "train/clip_fraction", "train/grad_norm",
            "rollout/response_length", "rollout/tokens_per_s", "rollout/zero_advantage_groups", "timing_s/rollout", "timing_s/train",
            "timing_s/iteration", "perf/checkpoint_bytes", "perf/weights_read_bytes", "perf/checkpoint_state_bytes",
            "perf/weights_read_bytes_max_node"}


def _tensorboard_counts(directory: Path) -> dict[str, collections.Counter]:
    """Per tag, how many events each step has, over every event file (tensorboard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: collections.Counter(e.step for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def _wandb_counts(directory: Path, run_id: str) -> dict[str, collections.Counter]:
    """Per key, how many history records of each step hold it, over every local file of the
    run (each start of it writes one), read with `wandb leet inspect --json`."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    files = sorted(directory.glob(f"*-{run_id}/run-{run_id}.wandb"))
    assert files, f"no wandb run files of {run_id} under {directory}"
    for f in files:
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)], capture_output=True, text=True,
                             timeout=120, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        for line in out.stdout.splitlines():
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("type") == "history":
                step = record["history"]["step"]["num"]
                for key in record["history"]["item"]:
                    if not key.startswith("_"):
                        counts[key][step] += 1
    return counts


def _mlflow_counts(directory: Path, run_id: str) -> dict[str, collections.Counter]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=directory.as_uri())
    return {key: collections.Counter(m.step for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics}


def _tracking_state(layout: RunLayout) -> dict:
    return fsio.read_record(layout.tracking / "state.json") or {}


def test_every_iteration_reaches_each_backend_exactly_once_across_a_kill_9_and_a_resume(demo_data, tmp_path):
    log_path = tmp_path / "tracked"
    layout = RunLayout(log_path)
    flags = rl_flags(demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=3, settings=SMALL,
                     extra=["tracking.backends=tensorboard,wandb,mlflow"])
    # Rank 0 is held at the start of iteration 3, once iterations 1 and 2 are logged: then every
    # process of the run is killed with SIGKILL, wandb's own service included.
    procs = start_ranks(flags, 2, env_for={0: {"ORCHESTRATOR_FAULT": "hold@3:1"}})
    try:
        def logged_two():
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            backends = _tracking_state(layout).get("backends", {})
            return len(backends) == 3 and all(b.get("iteration") == 2 for b in backends.values())

        wait_for(logged_two, 240, "iterations 1 and 2 logged to the three backends")
        wait_state(layout, 0, "held", timeout=60)  # at the hold, past iteration 3's first phase, on a busy machine too
    finally:
        for p in procs:
            kill_tree(p.pid)
            p.wait(timeout=30)
    ids = _tracking_state(layout)["ids"]

    result = subprocess.run([sys.executable, "-m", "orchestrator", "local", *flags], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    state = _tracking_state(layout)
    assert state["ids"] == ids, "the resumed run must continue the same tracked runs"
    assert all(b["ok"] and b["iteration"] == 3 for b in state["backends"].values()), state

    for name, counts in (("tensorboard", _tensorboard_counts(layout.tracking / "tensorboard")),
                         ("wandb", _wandb_counts(layout.tracking / "wandb", ids["wandb"])),
                         ("mlflow", _mlflow_counts(layout.tracking / "mlflow", ids["mlflow"]))):
        assert EXPECTED <= set(counts), f"{name} lacks {sorted(EXPECTED - set(counts))}"
        for key, steps in counts.items():
            assert steps == {1: 1, 2: 1, 3: 1}, f"{name}: {key} has steps {dict(steps)}"
    wandb_starts = list((layout.tracking / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
    assert len(wandb_starts) == 2, "one offline run directory per start of the same wandb run"
    stray = [p for p in psutil.process_iter(["cmdline"]) if any(str(log_path) in part for part in (p.info["cmdline"] or []))]
    assert not stray, f"processes of the run left behind: {stray}"


def test_a_failing_backend_warns_once_and_the_run_goes_on(tmp_path):
    from tests.harness import run_flags

    log_path = tmp_path / "run"
    env = {**os.environ, "MLFLOW_TRACKING_URI": "nosuchscheme://nowhere"}
    flags = run_flags(log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=["tracking.backends=tensorboard,mlflow"])
    result = subprocess.run([sys.executable, "-m", "orchestrator", "local", *flags], capture_output=True, text=True, timeout=180,
                            env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    assert result.stdout.count("tracking: mlflow failed") == 1, result.stdout[-6000:]
    tracking = status_json(log_path)["tracking"]
    assert tracking["backends"]["mlflow"]["ok"] is False and "nosuchscheme" in tracking["backends"]["mlflow"]["error"]
    assert tracking["backends"]["tensorboard"] == {**tracking["backends"]["tensorboard"], "ok": True, "iteration": 2}
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "250"}).stdout
    assert "mlflow FAILED" in text and "tensorboard up to iteration 2" in text, text
    counts = _tensorboard_counts(RunLayout(log_path).tracking / "tensorboard")
    assert counts["timing_s/iteration"] == {1: 1, 2: 1}
