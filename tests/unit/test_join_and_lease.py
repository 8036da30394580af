"""Joining an attempt and taking the lease: the pure decisions, driven by a fake clock."""

from orchestrator.protocol.clock import FakeClock
from orchestrator.protocol.join import (
    Abandoned,
    Admit,
    Enter,
    Finished,
    MasterJoin,
    Rejoin,
    Started,
    TimedOut,
    Wait,
    WorkerJoin,
    WorkerView,
    config_mismatch,
)
from orchestrator.protocol.lease import HolderView, Lease, Refuse, Take, Takeover, Watch
from orchestrator.protocol.waiting import Deadline

PID = 4242


def lease(attempt="a1", generation=1, released=False):
    return Lease(generation, attempt, "n0", 100, 5.0, released)


def start(rank=1, pid=PID, attempt="a1"):
    return {"attempt": attempt, "joined": {"0": 100, str(rank): pid}}


def culprit():
    return {"culprit": {"rank": 0, "host": "n0", "iteration": 1, "phase": "1:rollout", "kind": "error", "error": "boom"}}


# -- master ----------------------------------------------------------------------------------


def test_master_admits_ranks_as_they_join_and_completes_when_none_is_missing():
    clock = FakeClock()
    join = MasterJoin("a1", 3, Deadline.after(60, "ranks to join", clock))
    assert join.missing == (1, 2)
    assert join.decide({1: None, 2: None}) == Wait()
    a = join.decide({1: {"attempt": "a1", "host": "n1"}, 2: None})
    assert a == Admit({1: {"attempt": "a1", "host": "n1"}}, complete=False) and join.missing == (2,)
    assert join.decide({2: {"attempt": "a0", "host": "n2"}}) == Wait()  # a record of an older attempt
    a = join.decide({2: {"attempt": "a1", "host": "n2"}})
    assert a.complete and set(join.joins) == {1, 2}


def test_master_times_out_naming_the_missing_ranks_only_after_the_deadline():
    clock = FakeClock()
    join = MasterJoin("a1", 4, Deadline.after(60, "ranks to join", clock))
    join.decide({1: {"attempt": "a1", "host": "n1"}, 2: None, 3: None})
    clock.advance(59.9)
    assert join.decide({2: None, 3: None}) == Wait()
    clock.advance(0.2)
    assert join.decide({2: None, 3: None}) == TimedOut((2, 3))


def test_single_node_master_is_complete_at_once():
    assert MasterJoin("a1", 1, Deadline.after(1, "x", FakeClock())).decide({}) == Admit({}, complete=True)


def test_config_mismatch_names_the_first_rank_and_the_keys_that_differ():
    mine = {"seed": 0, "num_nodes": 3}
    joins = {2: {"fingerprint": {"seed": 1, "num_nodes": 3}}, 1: {"fingerprint": dict(mine)}}
    assert config_mismatch(mine, joins) == (2, "seed: master 0 vs rank 2 1")
    assert config_mismatch(mine, {1: {"fingerprint": dict(mine)}}) is None


# -- worker ----------------------------------------------------------------------------------


def worker():
    return WorkerJoin(rank=1, pid=PID, run="/runs/x")


def test_worker_waits_for_a_lease_then_enters_its_attempt_then_starts():
    clock = FakeClock()
    deadline = Deadline.after(30, "the master", clock)
    w = worker()
    assert w.decide(WorkerView(None), deadline).message.startswith("waiting for the master (rank 0)")
    assert w.decide(WorkerView(lease(released=True)), deadline).message.startswith("waiting for the master")
    assert w.decide(WorkerView(lease()), deadline) == Enter(lease())
    w.joined = "a1"
    assert w.decide(WorkerView(lease(), joined_start=None), deadline) == Wait()
    s = start()
    assert w.decide(WorkerView(lease(), s, None, s, None), deadline) == Started(s)


def test_worker_that_joined_sees_its_start_even_after_the_lease_moved_on():
    w = worker()
    w.joined = "a1"
    s = start()
    view = WorkerView(lease("a2", 2, released=True), joined_start=s)
    assert w.decide(view, Deadline.after(1, "x", FakeClock())) == Started(s)


def test_worker_ends_when_no_master_holds_a_run_that_is_finished():
    deadline = Deadline.after(30, "the master", FakeClock())
    w = worker()
    assert w.decide(WorkerView(None, finished=True), deadline) == Finished()
    assert w.decide(WorkerView(lease(released=True), finished=True), deadline) == Finished()
    assert w.decide(WorkerView(lease(), finished=True), deadline) == Enter(lease())  # a live master decides
    w.joined = "a1"
    s = start()
    view = WorkerView(lease("a1", released=True), joined_start=s, finished=True)
    assert w.decide(view, deadline) == Started(s)  # its own attempt started (and ended) between two polls


def test_worker_follows_an_abort_of_its_own_attempt():
    w = worker()
    w.joined = "a1"
    action = w.decide(WorkerView(lease(), joined_abort=culprit()), Deadline.after(1, "x", FakeClock()))
    assert isinstance(action, Abandoned) and action.culprit.error == "boom"


def test_worker_never_joins_an_attempt_that_ended_started_without_it_or_that_it_left():
    deadline = Deadline.after(30, "x", FakeClock())
    w = worker()
    assert "has ended" in w.decide(WorkerView(lease(), lease_abort=culprit()), deadline).message
    assert "already started without this rank" in w.decide(WorkerView(lease(), lease_start=start(pid=1)), deadline).message
    w.joined = "a1"
    w.leave()
    assert w.joined is None and w.left == {"a1"}
    assert "died" in w.decide(WorkerView(lease()), deadline).message
    assert w.decide(WorkerView(lease("a2", 2)), deadline) == Enter(lease("a2", 2))


def test_worker_in_an_attempt_that_started_with_another_process_as_its_rank_waits():
    w = worker()
    w.joined = "a1"
    other = start(pid=PID + 1)
    action = w.decide(WorkerView(lease(), other, None, other, None), Deadline.after(1, "x", FakeClock()))
    assert "another process as rank 1" in action.message


def test_elastic_worker_asks_to_rejoin_a_running_attempt_and_a_new_nonce_is_not_the_process_that_started():
    deadline = Deadline.after(30, "x", FakeClock())
    w = WorkerJoin(rank=1, pid=PID, run="/runs/x", elastic=True, nonce="n1")
    running = {**start(pid=PID + 1), "nonces": {"1": "n0"}}
    assert w.decide(WorkerView(lease(), lease_start=running), deadline) == Enter(lease(), rejoin=True)
    w.joined = "a1"
    assert w.decide(WorkerView(lease(), running, None, running, None), deadline) == Rejoin(running)
    # The same process (SIGCONT after the run went on without it) joins again with a new nonce.
    same = {**start(pid=PID), "nonces": {"1": "n0"}}
    assert w.decide(WorkerView(lease(), same, None, same, None), deadline) == Rejoin(same)
    w.nonce = "n0"
    assert w.decide(WorkerView(lease(), same, None, same, None), deadline) == Started(same)
    w.leave(for_good=False)
    assert w.joined is None and w.left == set()


def test_membership_marks_out_the_silent_process_and_knows_a_new_one_asking_back():
    from orchestrator.protocol.membership import Members

    m = Members()
    m.mark_out(2, iteration=3, phase="1:rollout", host="n2", reason="no heartbeat", nonce="old")
    assert m.is_out(2, "old") and not m.is_out(2, "new") and not m.is_out(1, None)
    assert not m.wants_back(2, {"nonce": "old"}) and not m.wants_back(2, None) and m.wants_back(2, {"nonce": "new"})
    m.admit(2, iteration=4, host="n2", nonce="new")
    assert m.out == {} and m.admitted[2]["iteration"] == 4 and [e["event"] for e in m.events] == ["out", "rejoined"]


def test_a_training_round_is_declared_for_one_iteration_without_the_ranks_out_and_survives_a_write(tmp_path):
    from orchestrator.protocol.membership import Members

    m = Members()
    assert m.round_of(3) is None
    m.mark_out(2, iteration=3, phase="10:train", host="n2", reason="no heartbeat", nonce="old")
    m.declare_round(3, 1)
    assert m.round_of(3) == (1, frozenset({2})) and m.round_of(4) is None
    m.write(tmp_path / "members.json")
    back = Members.read(tmp_path / "members.json")
    assert back.round_of(3) == (1, frozenset({2})) and back.out.keys() == {2}


def test_worker_times_out_only_while_waiting_after_its_deadline():
    clock = FakeClock()
    deadline = Deadline.after(30, "x", clock)
    w = worker()
    clock.advance(29)
    assert isinstance(w.decide(WorkerView(None), deadline), Wait)
    clock.advance(2)
    assert w.decide(WorkerView(None), deadline) == TimedOut()
    assert w.decide(WorkerView(lease()), deadline) == Enter(lease())  # a master came: join it even now


# -- lease -----------------------------------------------------------------------------------


def hb(counter, state="working"):
    return {"counter": counter, "pid": 100, "state": state}


def test_free_and_released_leases_are_taken_at_once_with_the_next_generation():
    assert Takeover(None, 10).decide(None, 0.0) == Take(1, holder_dead=False)
    assert Takeover(lease(generation=4, released=True), 10).decide(None, 0.0) == Take(5, holder_dead=False)


def test_holder_on_this_host_is_alive_exactly_when_its_process_is():
    assert Takeover(lease(), 10).decide(HolderView(True, None), 0.0) == Refuse(lease())
    assert Takeover(lease(), 10).decide(HolderView(False, hb(3)), 0.0) == Take(2, holder_dead=True)


def test_remote_holder_whose_counter_moves_is_alive():
    clock, t = FakeClock(), Takeover(lease(), 10)
    assert t.decide(HolderView(None, hb(1)), clock.monotonic()) == Watch()
    clock.advance(1)
    assert t.decide(HolderView(None, hb(1)), clock.monotonic()) == Watch()
    clock.advance(1)
    assert t.decide(HolderView(None, hb(2)), clock.monotonic()) == Refuse(lease())


def test_remote_holder_whose_counter_stands_still_for_the_timeout_is_dead():
    clock, t = FakeClock(), Takeover(lease(generation=7), 10)
    assert t.decide(HolderView(None, hb(1)), clock.monotonic()) == Watch()
    clock.advance(9.5)
    assert t.decide(HolderView(None, hb(1)), clock.monotonic()) == Watch()
    clock.advance(1)
    assert t.decide(HolderView(None, hb(1)), clock.monotonic()) == Take(8, holder_dead=True)


def test_remote_holder_without_a_readable_heartbeat_is_dead_after_the_timeout():
    clock, t = FakeClock(), Takeover(lease(), 5)
    assert t.decide(HolderView(None, None), clock.monotonic()) == Watch()
    clock.advance(5.5)
    assert t.decide(HolderView(None, None), clock.monotonic()) == Take(2, holder_dead=True)


def test_holder_whose_heartbeat_says_it_ended_is_replaced_at_once():
    assert Takeover(lease(), 10).decide(HolderView(None, hb(9, state="failed")), 0.0) == Take(2, holder_dead=True)


# -- deadlines on a fake clock ---------------------------------------------------------------


def test_deadline_reads_its_own_clock():
    clock = FakeClock()
    d = Deadline.after(10, "x", clock)
    assert d.remaining() == 10 and not d.expired()
    clock.advance(10)
    assert d.expired()
    assert d.extended(5).remaining() == 5
    assert not Deadline.never("x").expired()
