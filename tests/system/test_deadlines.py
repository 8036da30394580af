"""Every wait has a deadline: a rank stuck in a phase's work is stopped and named."""

import re
import time

import pytest

from orchestrator.phase_table import Phase
from tests.harness import run_flags, status_json

pytestmark = pytest.mark.timeout(90)


def test_work_that_outlives_its_phase_deadline_stops_the_rank_and_the_run_names_it(cluster):
    flags = run_flags(cluster.log_path, max_iterations=1, extra=["deadlines.train=2"])
    # rank 1 hangs in training (alive: its heartbeat keeps beating)
    procs = cluster.start_all(flags, env_for={1: {"ORCHESTRATOR_FAULT": f"hold@1:{int(Phase.TRAIN)}"}})
    codes = cluster.wait_all(procs, timeout=40)
    assert codes[1] == 1, procs[1].output()
    assert "deadline at iteration 1, phase 10:train: the phase's work ran past deadlines.train=2 s" in procs[1].output()
    assert codes[0] == 3 and codes[2] == 3
    for p in (procs[0], procs[2]):
        assert re.search(r"rank 1 on host \S+ hit a deadline at iteration 1, phase 10:train", p.output()), p.output()
    failure = status_json(cluster.log_path)["failure"]
    assert (failure["rank"], failure["kind"], failure["phase"]) == (1, "deadline", "10:train")


def test_a_barrier_waits_for_the_whole_group_of_phases_it_closes(cluster):
    """Rollout (no barrier of its own) and its closing barrier share one budget: a rank whose
    rollout is slow but within deadlines.rollout is not declared late by rollout_done's."""
    flags = run_flags(cluster.log_path, max_iterations=1,
                      extra=["deadlines.rollout=6", "deadlines.rollout_done=1", "rehearsal.work_s=0"])
    started = time.monotonic()
    procs = cluster.start_all(flags, env_for={2: {"ORCHESTRATOR_FAULT": f"hold@1:{int(Phase.ROLLOUT)}"}})
    codes = cluster.wait_all(procs, timeout=60)
    assert time.monotonic() - started >= 6, "no rank may be declared late before the rollout deadline"
    assert codes == [3, 3, 1]
    assert "the phase's work ran past deadlines.rollout=6 s" in procs[2].output()
    assert re.search(r"rank 2 on host \S+ hit a deadline at iteration 1, phase 1:rollout", procs[0].output())
