"""The barrier rule (protocol/barrier.py), driven with plain records and a fake clock."""

from orchestrator.phase_table import Phase
from orchestrator.protocol import barrier, schema
from orchestrator.protocol.barrier import MasterBarrier, ReleaseAll, TimedOut, Wait
from orchestrator.protocol.clock import FakeClock
from orchestrator.protocol.schema import Arrival, Point, Release
from orchestrator.protocol.waiting import Deadline

NONE = frozenset()


def rule(clock, point=Point(2, Phase.ROLLOUT_DONE), num_nodes=3, attempt="a1"):
    return MasterBarrier(attempt, point, num_nodes, Deadline.after(60, "deadlines.rollout", clock))


def arrival(point=Point(2, Phase.ROLLOUT_DONE), attempt="a1", **payload):
    return Arrival(attempt, point.iteration, point.phase, payload, point.round)


def test_barrier_releases_with_every_payload_once_all_ranks_arrived():
    b = rule(FakeClock())
    assert b.missing(NONE) == (0, 1, 2)
    assert b.decide({0: arrival(n=1), 1: None, 2: arrival(n=3)}, NONE) == Wait((1,))
    assert b.missing(NONE) == (1,)
    assert b.decide({1: arrival(n=2)}, NONE) == ReleaseAll({0: {"n": 1}, 1: {"n": 2}, 2: {"n": 3}})


def test_barrier_ignores_arrivals_of_another_attempt_phase_iteration_or_round():
    point = Point(3, Phase.TRAIN, 1)
    b = rule(FakeClock(), point, num_nodes=2)
    stale = [arrival(point, attempt="a0"), arrival(Point(3, Phase.TRAIN_CONFIG)), arrival(Point(2, Phase.TRAIN, 1)),
             arrival(Point(3, Phase.TRAIN, 0))]
    for a in stale:
        assert b.decide({0: arrival(point), 1: a}, NONE) == Wait((1,))
    assert isinstance(b.decide({1: arrival(point)}, NONE), ReleaseAll)


def test_barrier_times_out_on_the_fake_clock_naming_the_ranks_missing():
    clock = FakeClock()
    b = rule(clock)
    assert b.decide({0: arrival(), 1: None, 2: None}, NONE) == Wait((1, 2))
    clock.advance(59.9)
    assert b.decide({1: None, 2: None}, NONE) == Wait((1, 2))
    clock.advance(0.2)
    assert b.decide({1: None, 2: None}, NONE) == TimedOut((1, 2))


def test_barrier_stops_waiting_for_a_rank_marked_out_and_drops_what_it_wrote():
    b = rule(FakeClock())
    assert b.decide({0: arrival(n=0), 1: arrival(n=1), 2: None}, NONE) == Wait((2,))
    assert b.decide({2: None}, frozenset({2})) == ReleaseAll({0: {"n": 0}, 1: {"n": 1}})
    b = rule(FakeClock())
    b.decide({0: arrival(), 1: arrival(), 2: None}, NONE)
    assert b.missing(frozenset({1})) == (2,)
    assert b.decide({2: arrival()}, frozenset({1})) == ReleaseAll({0: {}, 2: {}})  # rank 1's arrival no longer counts


def test_barrier_waits_again_for_a_rank_admitted_back():
    b = rule(FakeClock(), Point(4, Phase.SYNC_START))
    p = Point(4, Phase.SYNC_START)
    assert b.decide({0: arrival(p), 1: arrival(p)}, frozenset({2})) == ReleaseAll({0: {}, 1: {}})
    b = rule(FakeClock(), p)
    assert b.decide({0: arrival(p), 1: arrival(p)}, frozenset({2})) == ReleaseAll({0: {}, 1: {}})
    b = rule(FakeClock(), p)
    b.decide({0: arrival(p), 1: None}, frozenset({2}))
    assert b.decide({1: arrival(p), 2: None}, NONE) == Wait((2,))  # admitted while the barrier waits
    assert isinstance(b.decide({2: arrival(p)}, NONE), ReleaseAll)


def test_worker_takes_only_the_release_of_its_own_point():
    point = Point(3, Phase.TRAIN, 1)
    assert barrier.released(None, point) is None
    assert barrier.released(Release(3, Phase.TRAIN, {"x": 1}, 0), point) is None
    assert barrier.released(Release(2, Phase.TRAIN, {"x": 1}, 1), point) is None
    assert barrier.released(Release(3, Phase.TRAIN, {"x": 1}, 1), point) == {"x": 1}


def test_barrier_records_keep_their_file_format(tmp_path):
    schema.write(tmp_path / "a.json", Arrival("a1", 2, Phase.ROLLOUT_DONE, {"n": 1}))
    schema.write(tmp_path / "r.json", Release(3, Phase.TRAIN, {"out": [2]}, 1))
    from orchestrator.protocol import fsio

    assert fsio.read_record(tmp_path / "a.json") == {"attempt": "a1", "iteration": 2, "phase": 2, "payload": {"n": 1}}
    assert fsio.read_record(tmp_path / "r.json") == {"iteration": 3, "phase": 10, "round": 1, "decision": {"out": [2]}}
    assert schema.read(tmp_path / "r.json", Release) == Release(3, Phase.TRAIN, {"out": [2]}, 1)
    (tmp_path / "bad.json").write_text("{")
    assert schema.read(tmp_path / "bad.json", Release) is None and schema.read(tmp_path / "none.json", Release) is None
