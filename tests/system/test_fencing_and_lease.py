"""Sync files of a crashed attempt never release a barrier; one live master at a time
(issue 2, done-when 5 and 6)."""

import os
import re
import signal
import time

import pytest

from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from tests.harness import NODE_TIMEOUT_S, aggregate_task_ids, run_flags, wait_for, wait_state

pytestmark = pytest.mark.timeout(120)


def test_arrival_from_a_crashed_attempt_never_releases_the_barrier(cluster):
    flags = run_flags(cluster.log_path, max_iterations=1)
    barrier = int(Phase.SHARDS_SEALED)
    procs = cluster.start_all(flags, env_for={
        0: {"ORCHESTRATOR_FAULT": f"hold@1:{barrier}"},  # the master is slow to reach the barrier
        2: {"ORCHESTRATOR_FAULT": f"hold-after-arrive@1:{barrier}"},  # rank 2 arrives, then dies
    })
    layout = cluster.layout
    wait_state(layout, 2, "held")
    wait_state(layout, 0, "held")
    crashed = fsio.read_record(layout.lease)["attempt"]
    assert fsio.read_record(layout.attempt(crashed).arrive(2))["phase"] == barrier
    os.kill(procs[2].pid, signal.SIGKILL)
    procs[2].wait(timeout=5)
    assert cluster.wait_all(procs[:2], timeout=NODE_TIMEOUT_S + 10) == [3, 3]
    assert fsio.read_record(layout.progress)["phase"] == int(Phase.ROLLOUT_DONE), "barrier 3 was never released"

    # Ranks 0 and 1 come back without rank 2: rank 2's arrival is in the old attempt only.
    short_join = flags + ["coordination.join_timeout_s=4"]
    started = time.monotonic()
    again = [cluster.start(0, short_join), cluster.start(1, short_join)]
    codes = cluster.wait_all(again, timeout=40)
    waited = time.monotonic() - started
    assert codes == [3, 3], "\n".join(p.output() for p in again)
    assert waited >= 4, "they must wait for rank 2 before failing"
    for p in again:
        assert re.search(r"rank 2 .*did not join", p.output()), p.output()
    new = fsio.read_record(layout.lease)["attempt"]
    assert new != crashed
    assert fsio.read_record(layout.progress)["phase"] == int(Phase.ROLLOUT_DONE)


@pytest.mark.slow
def test_second_master_is_refused_then_takes_over_once_the_old_one_is_dead(cluster):
    flags = run_flags(cluster.log_path, max_iterations=2, extra=["rehearsal.work_s=1"])
    procs = cluster.start_all(flags)
    layout = cluster.layout
    wait_for(lambda: fsio.read_record(layout.progress), 30, "the first barrier release")

    intruder = cluster.start(0, flags)
    assert intruder.wait(timeout=30) == 2, intruder.output()
    assert f"host {os.uname().nodename}" in intruder.output() or "host " in intruder.output()
    assert f"pid {procs[0].pid}" in intruder.output()

    # The live master dies; a master on "another host" must see it dead for node_timeout_s first.
    os.kill(procs[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    procs[0].wait(timeout=5)
    successor = cluster.start(0, flags, env={"ORCHESTRATOR_HOST": "node-b"})
    assert cluster.wait_all([procs[1], procs[2]], timeout=NODE_TIMEOUT_S + 10) == [3, 3]
    workers = [cluster.start(1, flags), cluster.start(2, flags)]  # once the old ones ended: each rank runs once per host
    assert successor.wait(timeout=90) == 0, successor.output()
    assert cluster.wait_all(workers, timeout=30) == [0, 0], "\n".join(p.output() for p in workers)
    lease = fsio.read_record(layout.lease)
    assert lease["generation"] == 2 and lease["host"] == "node-b"
    takeover = [e for e in successor.output().splitlines() if "holds lease generation 2" in e]
    assert takeover
    assert time.monotonic() - killed_at >= NODE_TIMEOUT_S
    for i in (1, 2):
        assert len(set(aggregate_task_ids(layout, i))) == len(aggregate_task_ids(layout, i)) == 12
