"""rl.max_staleness: the pipelined order of the phases, resume within it, and the bound on a
trajectory's age, each a pure rule."""

import pytest

from orchestrator.data import staleness
from orchestrator.data.staleness import StaleTrajectory
from orchestrator.phase_table import Phase, RLPhase
from orchestrator.protocol.schedule import finished, first_point, next_point, schedule
from orchestrator.protocol.schema import Progress


def halves(points):
    """The order as blocks: R (phases 0-6), L (7-10, training launched), F (11-13)."""
    out = []
    for iteration, phase in points:
        block = f"{'R' if phase <= Phase.EVAL else 'L' if phase <= Phase.TRAIN else 'F'}{iteration}"
        if not out or out[-1] != block:
            out.append(block)
    return out


def test_lockstep_order_is_unchanged_at_k_0():
    assert halves(schedule((1, Phase.SYNC_START), RLPhase.BOTH, 3, 0)) == ["R1", "L1", "F1", "R2", "L2", "F2", "R3", "L3", "F3"]


@pytest.mark.parametrize("k,expected", [
    (1, ["R1", "L1", "R2", "F1", "L2", "R3", "F2", "L3", "R4", "F3", "L4", "F4"]),
    (2, ["R1", "L1", "R2", "R3", "F1", "L2", "R4", "F2", "L3", "F3", "L4", "F4"]),
])
def test_the_rollout_of_an_iteration_is_walked_while_an_older_one_trains(k, expected):
    points = list(schedule((1, Phase.SYNC_START), RLPhase.BOTH, 4, k))
    assert halves(points) == expected
    assert sorted(points) == [(i, p) for i in range(1, 5) for p in Phase]  # every phase of every iteration, once


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_rollout_starts_before_the_checkpoint_its_bound_needs_is_published(k):
    published, launched, walked = 0, set(), set()
    for iteration, phase in schedule((1, Phase.SYNC_START), RLPhase.BOTH, 12, k):
        if phase is Phase.SYNC_START:
            assert published >= staleness.oldest_allowed(iteration, k)
            if iteration - 1 - k >= 0:
                assert published == iteration - 1 - k  # and not later: the rollout runs as early as it may
        if phase is Phase.ENGINE_STOP:
            assert (iteration, Phase.EVAL) in walked  # an update trains on an aggregate that exists
            assert published == iteration - 1  # from the checkpoint just before it
            launched.add(iteration)
        if phase is Phase.PUBLISH:
            assert iteration in launched
            published = iteration
        walked.add((iteration, phase))


@pytest.mark.parametrize("k", [1, 2])
def test_a_resume_continues_the_same_order_after_any_released_barrier(k):
    order = list(schedule((1, Phase.SYNC_START), RLPhase.BOTH, 5, k))
    for before, after in zip(order, order[1:]):
        assert first_point(next_point(Progress(*before, "a1", k), k), RLPhase.BOTH, 5, k) == after
    assert next_point(None, k) == (1, Phase.SYNC_START)
    assert list(schedule(order[17], RLPhase.BOTH, 5, k)) == order[17:]


def test_a_pipelined_run_is_finished_after_its_last_iteration_publishes_and_syncs():
    assert not finished(Progress(4, Phase.EVAL, "a1", 1), RLPhase.BOTH, 4)  # F3, L4, F4 are left
    assert not finished(Progress(3, Phase.SYNC_END, "a1", 1), RLPhase.BOTH, 4)
    assert finished(Progress(4, Phase.SYNC_END, "a1", 1), RLPhase.BOTH, 4)
    assert not finished(Progress(4, Phase.SYNC_END, "a1", 1), RLPhase.BOTH, 5)


def test_a_trajectory_past_the_bound_is_refused_never_dropped():
    staleness.check(5, 1, [3, 4], "agg")  # checkpoints 3 (staleness 1) and 4 (on-policy)
    with pytest.raises(StaleTrajectory, match=r"checkpoint 2, 2 checkpoints behind the update of iteration 5, past "
                                              r"rl.max_staleness=1 \(the oldest allowed is checkpoint 3\).*bug"):
        staleness.check(5, 1, [2, 4], "agg")
    with pytest.raises(StaleTrajectory, match="past rl.max_staleness=0"):
        staleness.check(5, 0, [3, 4], "agg")  # lockstep: only the checkpoint the update starts from
    with pytest.raises(StaleTrajectory, match="checkpoint 5, but the update of iteration 5 starts from checkpoint 4"):
        staleness.check(5, 2, [4, 5], "agg")
    staleness.check(1, 0, [0, 0], "agg")
    staleness.check(3, 1, None, "agg")  # records of an older version name no checkpoint
