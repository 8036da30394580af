"""`orchestrator recover` (issue 5): the inventory of a broken run, salvaging a killed
iteration's shards into an aggregate marked partial, training on it only when asked, and
refusing to touch a live run."""

import json
import os
import signal
import subprocess
import sys

import pytest

from orchestrator.data import shards
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from tests.harness import hold_after_first_batch, kill_tree, rl_flags, run_flags, start_ranks, status_json, wait_for, wait_held_mid_rollout, wait_state


def recover(log_path, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "orchestrator", "recover", f"--log-path={log_path}", *args],
                          capture_output=True, text=True, timeout=timeout)


def _alive(log_path):
    """Ranks whose heartbeat is fresh; none before the run has a lease."""
    if not RunLayout(log_path).lease.exists():
        return []
    return [r["rank"] for r in status_json(log_path)["ranks"] if r["alive"]]


def _valid_records(path):
    return sum(1 for _ in shards.iter_valid_lines(path)) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_salvage_after_kill_9_mid_rollout_then_train_only_when_allowed(demo_data, tmp_path):
    log_path = tmp_path / "run"
    # Without work stealing rank 1 keeps its share (with stealing, a faster rank may take all of it).
    flags = rl_flags(demo_data, log_path, max_iterations=1, extra=["rl.train_tasks=128", "coordination.work_stealing=false"])
    procs = start_ranks(flags, 3, env_for=hold_after_first_batch(1))  # its 32 tasks in two requests: held after the first
    layout = RunLayout(log_path)
    try:
        wait_held_mid_rollout(layout, 1)
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=10)
        assert [procs[0].wait(timeout=90), procs[2].wait(timeout=90)] == [3, 3]
    finally:
        for p in procs:
            kill_tree(p.pid)
    wait_for(lambda: not _alive(log_path), 60, "every heartbeat to go stale")

    # The inventory: what each rank's shard holds.
    it = layout.iteration(1)
    dry = recover(log_path, "--json")
    assert dry.returncode == 0, dry.stderr
    inv = json.loads(dry.stdout)
    ranks = {r["rank"]: r for r in inv["iterations"][0]["splits"]["train"]["ranks"]}
    assert ranks[1]["state"] == "partial" and 0 < ranks[1]["records"] < 32
    for r in (0, 1, 2):
        assert ranks[r]["records"] == _valid_records(it.shard("train", r))

    # Salvage: a dry run writes nothing; --apply writes the partial aggregate.
    preview = json.loads(recover(log_path, "--salvage=1", "--json").stdout)["salvage"]
    assert preview["written"] is None and not it.aggregate("train").exists()
    done = recover(log_path, "--salvage=1", "--apply", "--json")
    assert done.returncode == 0, done.stderr
    salvaged = json.loads(done.stdout)["salvage"]
    expected = {f"rank {r}": _valid_records(it.shard("train", r)) for r in (0, 1, 2)}
    assert salvaged["per_rank"] == expected == preview["per_rank"]
    m = shards.sealed(it.aggregate("train"))
    assert m.extra["partial"] is True and m.extra["per_source"] == expected and m.count == sum(expected.values()) < 128
    ids = [rec["task_id"] for _e, _r, rec in shards.iter_valid_lines(it.aggregate("train"))]
    assert len(ids) == len(set(ids)) == m.count

    # Training refuses a partial aggregate unless told, then trains on it.
    update = rl_flags(demo_data, log_path, rl_phase="update", max_iterations=1)
    refused = subprocess.run([sys.executable, "-m", "orchestrator", "local", *update], capture_output=True, text=True, timeout=240)
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert "is partial" in refused.stdout and "rl.train_on_partial=true" in refused.stdout
    assert not layout.checkpoint(1).exists()
    trained = subprocess.run([sys.executable, "-m", "orchestrator", "local", *update, "rl.train_on_partial=true"],
                             capture_output=True, text=True, timeout=240)
    assert trained.returncode == 0, trained.stdout[-4000:]
    assert any(layout.checkpoint(1).glob("model*.safetensors")), "the first version is written whole (by each train worker, its part)"
    assert json.loads(layout.checkpoint(1).joinpath("train_stats.json").read_text())["records"] == m.count


@pytest.mark.timeout(120)
def test_recover_refuses_while_ranks_are_alive_naming_them(cluster):
    flags = run_flags(cluster.log_path, num_nodes=2, weights="1,1")
    procs = cluster.start_all(flags, n=2, env_for={r: {"ORCHESTRATOR_FAULT": "hold@1:1"} for r in (0, 1)})
    wait_for(lambda: _alive(cluster.log_path) == [0, 1], 60, "both ranks to be alive")
    result = recover(cluster.log_path, "--apply")
    assert result.returncode == 2
    text = " ".join(result.stderr.split())
    assert "the run is alive: rank 0 on" in text and "rank 1 on" in text and "--force" in text
    lease = fsio.read_record(cluster.layout.lease)
    assert lease and not lease["released"]  # nothing was moved
    cluster.kill_all()
    for p in procs:
        p.wait(timeout=30)


@pytest.mark.timeout(120)
def test_recover_moves_a_dead_masters_lease_aside(cluster):
    """The next master then starts at once; the old lease is kept under control/recovered/."""
    flags = run_flags(cluster.log_path, num_nodes=1, weights="1")
    proc = cluster.start(0, flags, env={"ORCHESTRATOR_FAULT": "hold@1:1", "ORCHESTRATOR_HOST": "gone-host"})
    wait_state(cluster.layout, 0, "held")  # started: status knows the run's node timeout
    kill_tree(proc.pid)
    proc.wait(timeout=30)
    wait_for(lambda: not _alive(cluster.log_path), 30, "the heartbeat to go stale")
    before = fsio.read_record(cluster.layout.lease)
    dry = recover(cluster.log_path)
    assert dry.returncode == 0 and "would do (dry run; add --apply): move" in " ".join(dry.stdout.split())
    assert fsio.read_record(cluster.layout.lease) == before
    applied = recover(cluster.log_path, "--apply")
    assert applied.returncode == 0, applied.stderr
    after = fsio.read_record(cluster.layout.lease)
    assert after["released"] and after["generation"] == before["generation"]
    kept = list((cluster.layout.control / "recovered").glob("*/lease.json"))
    assert len(kept) == 1 and fsio.read_record(kept[0]) == before
    again = cluster.start(0, flags)  # another host identity would otherwise watch the old heartbeat first
    assert again.wait(timeout=90) == 0, again.output()[-3000:]
