"""The coordination's one wait loop (coordination/executor.py): what it does with each kind of
action a rule answers."""

import logging

import pytest

from orchestrator.coordination import executor
from orchestrator.errors import DeadlineExceeded
from orchestrator.protocol.actions import TimedOut, Wait
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline

FAST = Backoff(0.001, 0.001)


def _run(actions: list, act=lambda action: action, deadline_s: float = 5.0):
    answers = iter(actions)
    op = executor.Operation(lambda: next(answers), lambda a: DeadlineExceeded(f"timed out: {a}"), act)
    return executor.run(op, Deadline.after(deadline_s, "the test"), cancel=CancelToken(), backoff=FAST)


def test_a_wait_reads_again_and_says_its_message_once(caplog):
    with caplog.at_level(logging.INFO, logger="orchestrator.coordination.executor"):
        assert _run([Wait(message="waiting for the master"), Wait(message="waiting for the master"), Wait(), "done"]) == "done"
    assert caplog.text.count("waiting for the master") == 1


def test_the_rules_own_action_goes_to_act_which_ends_the_wait_or_reads_again():
    seen = []
    assert _run(["not yet", "now"], act=lambda a: seen.append(a) or (a if a == "now" else None)) == "now"
    assert seen == ["not yet", "now"]


def test_a_rule_that_timed_out_raises_what_the_operation_makes_of_it():
    with pytest.raises(DeadlineExceeded, match=r"TimedOut\(missing=\(2, 3\)\)"):
        _run([Wait(), TimedOut((2, 3))])


def test_the_loops_own_deadline_raises_the_operations_error_with_no_action():
    op = executor.Operation(lambda: Wait(), lambda a: DeadlineExceeded(f"timed out: {a}"))
    with pytest.raises(DeadlineExceeded, match="timed out: None"):
        executor.run(op, Deadline.after(0.05, "the test"), cancel=CancelToken(), backoff=FAST)


def test_a_cancelled_rank_stops_waiting_with_the_reason():
    cancel = CancelToken()
    cancel.cancel(RuntimeError("stopped"))
    with pytest.raises(RuntimeError, match="stopped"):
        executor.run(executor.Operation(lambda: Wait(), lambda a: DeadlineExceeded("x")), Deadline.never("the test"),
                     cancel=cancel, backoff=FAST)
