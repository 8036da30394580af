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


# -- fan-in: group leaders pass arrivals on (coordination.fan_in) ---------------------------------

def group_file(ranks, point=Point(2, Phase.ROLLOUT_DONE), attempt="a1", leader=None):
    return schema.GroupArrival(attempt, point.iteration, point.phase, leader or min(ranks), {r: {"n": r} for r in ranks},
                               point.round)


def test_fan_in_is_off_below_its_size_and_groups_the_workers_by_sqrt_above():
    assert barrier.FanIn.of(63, 0) is None and barrier.FanIn.of(1024, 1) is None
    auto = barrier.FanIn.of(1024, 0)
    assert auto.size == 32 and auto.count == 32  # 1,023 workers: 31 groups of 32 and one of 31
    assert auto.ranks(0) == tuple(range(1, 33)) and auto.ranks(31) == tuple(range(993, 1024))
    assert barrier.FanIn.of(64, 0).size == 8
    forced = barrier.FanIn.of(5, 2)
    assert [forced.ranks(g) for g in range(forced.count)] == [(1, 2), (3, 4)]
    assert forced.group(4) == 1 and forced.groups_of((0, 2, 3, 4)) == [0, 1]


def test_the_lowest_rank_of_a_group_in_the_run_leads_it():
    fan_in = barrier.FanIn.of(7, 3)
    assert fan_in.leader(0, NONE) == 1
    assert fan_in.leader(0, frozenset({1})) == 2  # the leader was lost: the next one leads
    assert fan_in.leader(1, frozenset({4, 5, 6})) is None


def test_the_master_takes_arrivals_from_group_files_of_its_point_and_reads_those_they_leave_out():
    fan_in, point = barrier.FanIn.of(7, 3), Point(2, Phase.ROLLOUT_DONE)
    records = {0: group_file((1, 3)), 1: group_file((4, 5, 6), point=Point(1, Phase.ROLLOUT_DONE))}
    found, own = fan_in.unpack("a1", point, (0, 1, 2, 3, 4, 5), records)
    assert found == {1: arrival(n=1), 3: arrival(n=3), 4: None, 5: None}  # group 1's file is of an earlier barrier
    assert own == (0, 2)  # the master's own; rank 2 is not in its leader's file (it came back after the leader wrote)
    assert fan_in.unpack("a2", point, (1,), records)[0] == {1: None}  # a file of another attempt is no news


def test_a_barrier_fed_by_group_files_releases_once_every_rank_in_the_run_is_in_one():
    fan_in, clock = barrier.FanIn.of(5, 2), FakeClock()
    b = rule(clock, num_nodes=5)
    found, own = fan_in.unpack("a1", b.point, b.missing(NONE), {0: group_file((1, 2)), 1: None})
    assert b.decide({**found, 0: arrival(n=0)}, NONE) == Wait((3, 4))
    found, _ = fan_in.unpack("a1", b.point, b.missing(NONE), {1: group_file((3, 4))})
    assert b.decide(found, NONE) == ReleaseAll({r: {"n": r} for r in range(5)})


def test_a_leader_collects_only_its_group_with_its_own_arrival_known():
    clock = FakeClock()
    b = MasterBarrier("a1", Point(2, Phase.ROLLOUT_DONE), 7, Deadline.after(60, "x", clock), arrived={4: {"n": 4}}, ranks=(4, 5, 6))
    assert b.missing(NONE) == (5, 6)
    assert b.decide({5: arrival(n=5), 6: None}, frozenset({6})) == ReleaseAll({4: {"n": 4}, 5: {"n": 5}})


def test_at_the_deadline_the_master_names_the_late_rank_or_the_leader_that_did_not_pass_arrivals_on():
    fan_in = barrier.FanIn.of(7, 3)
    assert barrier.blame_late((5, 6), frozenset({5}), fan_in, NONE)[0] == 6
    rank, why = barrier.blame_late((5, 6), frozenset({5, 6}), fan_in, NONE)
    assert rank == 4 and "rank 4, the leader of ranks 4,5,6" in why
    assert barrier.blame_late((5, 6), frozenset({5, 6}), fan_in, frozenset({4}))[0] == 5
    assert barrier.blame_late((2,), frozenset(), None, NONE)[0] == 2


def test_a_small_decision_rides_in_the_masters_heartbeat_and_a_plan_goes_by_release_json():
    assert barrier.small({}) == {} and barrier.small({"eval_due": True}) == {"eval_due": True}
    assert barrier.small({"plan": {"tasks": list(range(100))}}) is None
