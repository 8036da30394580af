"""A joining worker that follows the lease to a new master's attempt: real files under a temp
run, the worker's own join loop (coordination/attendance.py). A master replaced between the
worker's entry and its next read leaves the worker entering the new attempt, never failing."""

import os
import threading

import pytest

from orchestrator.config import RLPhase, RunConfig
from orchestrator.coordination.attendance import Attendance
from orchestrator.errors import Culprit, FailureKind, PeerFailed
from orchestrator.node import identity
from orchestrator.node.procs import Children
from orchestrator.protocol import fsio, records
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.lease import Lease
from orchestrator.protocol.waiting import CancelToken
from orchestrator.protocol.wire import HeartbeatState


def lease(layout: RunLayout, generation: int) -> Lease:
    held = Lease(generation, f"a{generation:06d}-abcdef", identity.host(), os.getpid(), None)
    layout.control.mkdir(parents=True, exist_ok=True)
    fsio.write_record(layout.lease, records.to_dict(held))
    return held


def test_a_lease_that_moves_on_while_the_worker_enters_is_followed_into_the_new_attempt(tmp_path):
    config = RunConfig(data_path=tmp_path, log_path=tmp_path / "run", rl_phase=RLPhase.BOTH, eval_interval=1, rank=1, num_nodes=2,
                       rank_weights=(1.0, 1.0))
    worker = Attendance(config, CancelToken(), Children())
    layout = worker.layout
    first = lease(layout, 1)
    entered = []
    enter = worker._enter

    def enter_then_master_replaced(attempt_id, *, rejoin=False):
        enter(attempt_id, rejoin=rejoin)
        entered.append(attempt_id)
        if len(entered) == 1:
            second = lease(layout, 2)  # the next read sees another master's attempt: enter it too
        else:  # that master gives up on the attempt: the wait ends with its culprit
            fsio.write_record(layout.attempt(attempt_id).abort,
                              {"culprit": records.to_dict(Culprit(0, identity.host(), None, None, FailureKind.JOIN,
                                                                    "given up for the test"))})

    worker._enter = enter_then_master_replaced
    done = threading.Timer(30, lambda: worker.cancel.cancel("the test's deadline"))
    done.start()
    try:
        with pytest.raises(PeerFailed, match="given up for the test"):
            worker.join(lambda: (0, None, None, ()))
    finally:
        done.cancel()
        if worker.heartbeat is not None:
            worker.heartbeat.close(HeartbeatState.STOPPED)
    assert entered == [first.attempt, "a000002-abcdef"]
    assert fsio.read_record(layout.attempt("a000002-abcdef").join(1))["rank"] == 1
