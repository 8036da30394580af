"""Warm processes (issue 15): a kept-alive trainer or a serving engine killed with kill -9
fails its rank at once, naming it; the others exit 3; the rerun finishes with every task
once and the optimizer continued."""

import json
import os
import re
import signal

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import (
    NODE_TIMEOUT_S,
    aggregate_task_ids,
    engine_pid,
    file_sha256,
    hold_after_first_batch,
    kill_trainer_mid_update,
    kill_tree,
    rl_flags,
    run_local,
    start_ranks,
    status_json,
    wait_held_mid_rollout,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ITERATIONS = 2


def _finish_and_check(flags, layout):
    """The rerun of the same command finishes every iteration with each task once, and every
    update continued the optimizer of the one before it."""
    result = run_local(flags, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]
    steps = 0
    for i in range(1, ITERATIONS + 1):
        ids = aggregate_task_ids(layout, i)
        assert len(ids) == 8 and len(set(ids)) == 8
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert stats["optimizer_continued_from_step"] == (steps or None), (i, stats)
        steps += stats["epochs"] * stats["steps_per_epoch"]
    return result


def test_a_trainer_killed_mid_training_fails_its_rank_naming_it_and_the_rerun_continues_its_optimizer(demo_data, tmp_path, monkeypatch):
    # One thread count for every run below, `run` ranks and `local` ones alike (local would
    # otherwise choose its own): the weights are compared bit for bit.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    log_path = tmp_path / "run"
    layout = RunLayout(log_path)
    flags = rl_flags(demo_data, log_path, extra=[f"--max-iterations={ITERATIONS}", "rl.epochs=8", "rl.micro_batch=3"])
    procs = start_ranks(flags, 3)
    kill_trainer_mid_update(procs, log_path, worker=2, rank=2, iteration=2, codes=[3, 3, 1], timeout=240)
    assert layout.checkpoint_stagings(2), "the killed try's staging directory"
    _finish_and_check(flags, layout)
    assert not list(layout.checkpoints.glob(".*.tmp")), "the rerun removes the staging directory the crash left"
    stats = json.loads((layout.checkpoint(2) / "train_stats.json").read_text())
    # iteration 1's checkpoint holds no training state (checkpoint.state_every): the rerun's new
    # trainers trained iteration 1 again from its aggregate, then iteration 2
    assert stats["policy_from"] == "replayed 1..1", stats
    # The same run without the crash ends with the same weights and moments, bit for bit.
    calm = tmp_path / "calm"
    result = run_local(rl_flags(demo_data, calm, extra=[f"--max-iterations={ITERATIONS}", "rl.epochs=8", "rl.micro_batch=3"]), timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]
    last = RunLayout(calm).checkpoint(ITERATIONS)
    names = sorted(p.relative_to(last).as_posix() for p in last.rglob("*.safetensors"))
    assert "optimizer/adamw.safetensors.index.json" in {p.relative_to(last).as_posix() for p in last.rglob("*.json")}, names
    assert names == sorted(p.relative_to(layout.checkpoint(ITERATIONS)).as_posix()
                           for p in layout.checkpoint(ITERATIONS).rglob("*.safetensors"))
    for name in names:  # the weights (or their delta), the fp32 master, the moments: every worker's part
        assert file_sha256(last / name) == file_sha256(layout.checkpoint(ITERATIONS) / name), name


def test_an_engine_killed_mid_rollout_fails_its_rank_naming_it_and_the_rerun_finishes(demo_data, tmp_path):
    log_path = tmp_path / "run"
    layout = RunLayout(log_path)
    # 128 tasks: rank 1 (weight 1 of 4) sends its 32 prompts in two requests of 16 and is held
    # after the first. Without work stealing: with it, a rank whose engine starts first may take
    # all of rank 1's share.
    flags = rl_flags(demo_data, log_path, extra=["--max-iterations=1", "rl.train_tasks=128", "coordination.work_stealing=false"])
    procs = start_ranks(flags, 3, env_for=hold_after_first_batch(1))
    try:
        wait_held_mid_rollout(layout, 1)
        pid = engine_pid(procs[1].pid)
        os.kill(pid, signal.SIGKILL)
        codes = [p.wait(timeout=NODE_TIMEOUT_S + 60) for p in procs]
        assert codes == [3, 1, 3], codes
    finally:
        for p in procs:
            kill_tree(p.pid)
    failure = status_json(log_path)["failure"]
    assert failure["rank"] == 1 and failure["iteration"] == 1, failure
    assert re.search(rf"engine 1 of rank 1 \(pid {pid}\) exited with code -9", failure["error"]), failure
    result = run_local(flags, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:]
    ids = aggregate_task_ids(layout, 1)
    assert len(ids) == 128 and len(set(ids)) == 128


def test_keep_alive_off_and_restart_start_a_trainer_and_an_engine_per_iteration(demo_data, tmp_path):
    """The mode before warm processes, which bench/iteration.py compares against, still runs."""
    log_path = tmp_path / "run"
    flags = rl_flags(demo_data, log_path, num_nodes=1, weights="1",
                   extra=["--max-iterations=2", "train.keep_alive=false", "rollout.weight_update=restart"])
    result = run_local(flags)
    assert result.returncode == 0, result.stdout[-6000:]
    layout = RunLayout(log_path)
    first, stats = (json.loads((layout.checkpoint(i) / "train_stats.json").read_text()) for i in (1, 2))
    assert stats["policy_from"] == "checkpoint", stats
    assert stats["optimizer_continued_from_step"] == first["epochs"] * first["steps_per_epoch"], stats
    timing = status_json(log_path)["iterations"]
    assert {"train.startup", "train.steps", "engine.release", "engine.restart"} <= set(timing[0]["timing"]["parts"]), timing[0]
    assert "train.startup" in timing[1]["timing"]["parts"]
    log = next((log_path / "engines").glob("r00000/engine*.log")).read_text()
    assert log.count("listening on") == 2 and "in place" not in log
