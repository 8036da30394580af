"""Checkpoint retention on real runs (issue 15, item 6): a 12-iteration rehearsal keeps exactly
the checkpoints `checkpoint.keep_last` and `checkpoint.keep_every` say, plus any a consumer
marker names; a master killed with SIGKILL in the middle of a removal leaves a run that the
same command resumes and finishes, with nothing half-removed left behind."""

import os

import pytest

from orchestrator.checkpoints import retention
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import TRASH_PREFIX, RunLayout, checkpoint_iteration
from tests.harness import NODE_TIMEOUT_S, heartbeat, kill_tree, run_flags, status_json, wait_for

pytestmark = pytest.mark.timeout(150)

# Two ranks, little simulated work: the iterations, not the work in them, are what counts here.
LIGHT = ["rehearsal.work_s=0.01", "rehearsal.tasks=4", "rehearsal.eval_tasks=2"]
TWO_RANKS = dict(num_nodes=2, weights="1,1", eval_interval=4)


def kept(layout: RunLayout) -> list[int]:
    return sorted(i for i in map(checkpoint_iteration, os.listdir(layout.checkpoints)) if i is not None)


def trash(layout: RunLayout) -> list[str]:
    return sorted(n for n in os.listdir(layout.checkpoints) if n.startswith(TRASH_PREFIX))


def _run(cluster, flags: list[str]) -> None:
    procs = cluster.start_all(flags, n=2)
    assert cluster.wait_all(procs, timeout=90) == [0, 0], "\n".join(p.output()[-3000:] for p in procs)


@pytest.mark.parametrize("keys,expected", [
    ((), [10, 11, 12]),
    (("checkpoint.keep_last=2", "checkpoint.keep_every=5"), [5, 10, 11, 12]),
], ids=["defaults", "keep_last=2,keep_every=5"])
def test_twelve_iterations_keep_exactly_the_checkpoints_the_keys_say(cluster, keys, expected):
    _run(cluster, run_flags(cluster.log_path, **TWO_RANKS, max_iterations=12, extra=[*LIGHT, *keys]))
    layout = cluster.layout
    assert kept(layout) == expected
    assert trash(layout) == []
    assert fsio.read_record(layout.current_checkpoint) == {"iteration": 12, "path": "checkpoints/iter-000012"}
    assert [it["complete"] for it in status_json(cluster.log_path)["iterations"]] == [True] * 12


def test_a_consumer_marker_keeps_the_old_checkpoint_it_names(cluster):
    layout = cluster.layout
    retention.mark_consumer(layout, 1, layout.checkpoint(2))  # rank 1 last loaded iteration 2's checkpoint
    _run(cluster, run_flags(cluster.log_path, **TWO_RANKS, max_iterations=12, extra=[*LIGHT, "checkpoint.keep_last=2"]))
    assert kept(layout) == [2, 11, 12]
    assert trash(layout) == []


def test_master_killed_in_the_middle_of_a_removal_resumes_and_finishes(cluster):
    flags = run_flags(cluster.log_path, **TWO_RANKS, max_iterations=8, extra=[*LIGHT, "checkpoint.keep_last=2"])
    layout = cluster.layout
    master = cluster.start(0, flags, env={"ORCHESTRATOR_FAULT": "hold-in-removal@6:13"})
    worker = cluster.start(1, flags)

    def holding_mid_removal():
        hb = heartbeat(layout, 0)
        return hb and hb["state"] == "held" and (hb["iteration"], hb["phase"]) == (6, Phase.SYNC_END.label) and trash(layout)

    [aside] = wait_for(holding_mid_removal, 60, "the master to hold between renaming a checkpoint aside and deleting it")
    assert aside.startswith(".trash-iter-000004.") and (layout.checkpoints / aside / "marker.json").is_file()
    assert kept(layout) == [5, 6]
    kill_tree(master.pid)
    assert master.wait(timeout=10) == -9
    assert worker.wait(timeout=NODE_TIMEOUT_S + 30) == 3, worker.output()[-3000:]
    assert trash(layout) == [aside]  # nothing else removed it

    procs = cluster.start_all(flags, n=2)  # the same command again, no fault
    assert cluster.wait_all(procs, timeout=90) == [0, 0], "\n".join(p.output()[-3000:] for p in procs)
    assert "left by a removal that was cut short" in procs[0].output()
    assert trash(layout) == []
    assert kept(layout) == [7, 8]
    status = status_json(cluster.log_path)
    assert status["failure"] is None
    assert [it["complete"] for it in status["iterations"]] == [True] * 8
