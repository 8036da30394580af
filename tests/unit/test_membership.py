"""The elastic membership rules (protocol/membership.py), over plain records."""

from orchestrator.errors import Culprit, FailureKind
from orchestrator.node import placement
from orchestrator.phase_table import Phase
from orchestrator.protocol import membership
from orchestrator.protocol.membership import Admission, Dropped, EndAttempt, MarkOut, TrainAgain, TrainRound
from orchestrator.protocol.schema import Members

CPU = placement.resolve(num_nodes=3, gpus_per_node=0, train_mapping="", rollout_mapping="")
FINGERPRINT = {"model": "m", "rl": 1}


def silent(rank=2, phase="1:rollout", iteration=3):
    return Culprit(rank, f"n{rank}", iteration, phase, FailureKind.DEAD, "no heartbeat for 6.1 s")


def judge(members, culprit, *, min_nodes=1, position=(3, Phase.ROLLOUT), released=None, round_=0, where=CPU):
    return membership.on_silent(members, culprit, num_nodes=3, min_nodes=min_nodes, placement=where, position=position,
                                train_released=released, train_round=round_)


def out(*ranks):
    m = Members()
    for r in ranks:
        m.mark_out(r, iteration=1, phase="1:rollout", host=f"n{r}", reason="silent", nonce=f"old{r}")
    return m


def test_a_silent_worker_is_marked_out_while_enough_ranks_are_left():
    c = silent()
    assert judge(Members(), c) == MarkOut(c)
    assert judge(out(1), c, min_nodes=1) == MarkOut(c)


def test_the_attempt_ends_when_fewer_than_min_nodes_would_be_left():
    action = judge(out(1), silent(), min_nodes=2)
    assert isinstance(action, EndAttempt) and "coordination.min_nodes=2" in action.reason and "only 1 rank(s)" in action.reason


def test_the_attempt_ends_when_the_ranks_left_hold_no_train_worker():
    gpus = placement.resolve(num_nodes=3, gpus_per_node=1, train_mapping="2", rollout_mapping="0-1")
    action = judge(Members(), silent(2), where=gpus)
    assert isinstance(action, EndAttempt) and "no train worker" in action.reason


def test_a_rank_lost_while_the_group_trains_gets_the_step_trained_again_as_the_next_round():
    c = silent(phase="10:train")
    assert judge(Members(), c, position=(3, Phase.TRAIN), round_=0) == MarkOut(c, retrain=1)
    assert judge(Members(), c, position=(3, Phase.TRAIN), round_=1) == MarkOut(c, retrain=2)
    assert judge(Members(), c, position=(3, Phase.TRAIN), released=3) == MarkOut(c)  # the step is done: nothing to redo
    assert judge(Members(), c, position=(3, Phase.PUBLISH)) == MarkOut(c)


def test_pipelined_a_rollout_node_lost_while_training_runs_in_the_background_is_marked_out_a_training_node_retrains_it():
    apart = placement.resolve(num_nodes=3, gpus_per_node=0, train_mapping="", rollout_mapping="", train_nodes="0-1",
                              rollout_nodes="2")
    rollout_node, training_node = silent(2, phase="1:rollout", iteration=4), silent(1, phase="1:rollout", iteration=4)
    background = {"position": (4, Phase.ROLLOUT), "released": 3, "where": apart}
    assert membership.on_silent(Members(), rollout_node, num_nodes=3, min_nodes=1, placement=apart, position=(4, Phase.ROLLOUT),
                                train_released=3, train_round=0, training_in_flight=3) == MarkOut(rollout_node)
    action = membership.on_silent(Members(), training_node, num_nodes=3, min_nodes=1, placement=apart,
                                  position=(4, Phase.ROLLOUT), train_released=3, train_round=0, training_in_flight=3)
    assert action == MarkOut(training_node, retrain=1, iteration=3)  # iteration 3 again, in the background, as round 1
    # a worker that trains it in the background learns the round whatever phase it walks
    m = out(1)
    m.declare_round(3, 1)
    assert membership.worker_news(m, 0, "n0", (3, Phase.TRAIN), train_round=0, out=frozenset()) == TrainAgain(1, frozenset({1}))
    assert judge(Members(), training_node, **background) == MarkOut(training_node)  # nothing in flight: as in lockstep


def test_entering_training_takes_the_declared_round_and_the_master_declares_one_for_ranks_gone_since():
    m = out(2)
    assert membership.train_round(m, 3, frozenset({2}), is_master=True) == TrainRound(0, frozenset({2}))
    assert membership.train_round(Members(), 3, frozenset(), is_master=False) == TrainRound(0, frozenset())
    # rank 1 went out after the last release: the master trains without it, as round 1
    m.mark_out(1, iteration=3, phase="9:train_config", host="n1", reason="silent", nonce="x")
    assert membership.train_round(m, 3, frozenset({2}), is_master=True) == TrainRound(1, frozenset({1, 2}), declare=True)
    m.declare_round(3, 1)
    assert membership.train_round(m, 3, frozenset({2}), is_master=False) == TrainRound(1, frozenset({1, 2}))
    assert membership.train_round(m, 3, frozenset({2}), is_master=True) == TrainRound(1, frozenset({1, 2}))
    assert membership.train_round(m, 4, frozenset({1, 2}), is_master=False) == TrainRound(0, frozenset({1, 2}))


def test_a_worker_learns_it_was_dropped_only_for_its_own_process():
    m = out(2)
    assert membership.worker_news(m, 2, "old2", (3, Phase.ROLLOUT), train_round=0, out=frozenset()) == Dropped()
    assert membership.worker_news(m, 2, "new", (3, Phase.ROLLOUT), train_round=0, out=frozenset()) is None
    assert membership.worker_news(m, 1, "n1", (3, Phase.ROLLOUT), train_round=0, out=frozenset()) is None


def test_a_worker_in_training_trains_again_once_a_later_round_is_declared():
    m = out(2)
    m.declare_round(3, 1)
    news = membership.worker_news(m, 1, "n1", (3, Phase.TRAIN), train_round=0, out=frozenset())
    assert news == TrainAgain(1, frozenset({2}))
    assert membership.worker_news(m, 1, "n1", (3, Phase.TRAIN), train_round=1, out=frozenset({2})) is None
    assert membership.worker_news(m, 1, "n1", (3, Phase.PUBLISH), train_round=0, out=frozenset()) is None
    assert membership.worker_news(m, 1, "n1", (4, Phase.TRAIN), train_round=0, out=frozenset()) is None


def test_an_out_rank_is_admitted_back_with_a_new_process_of_the_same_configuration():
    m = out(1, 2)
    joins = {
        1: {"attempt": "a1", "nonce": "new1", "host": "n1", "fingerprint": FINGERPRINT},
        2: {"attempt": "a1", "nonce": "old2", "host": "n2", "fingerprint": FINGERPRINT},  # the silent process itself
    }
    assert membership.admissions(m, joins, attempt="a1", fingerprint=FINGERPRINT) == Admission({1: joins[1]}, {})
    assert membership.admissions(m, {1: None, 2: None}, attempt="a1", fingerprint=FINGERPRINT) == Admission({}, {})
    other = {1: {**joins[1], "attempt": "a0"}}
    assert membership.admissions(m, other, attempt="a1", fingerprint=FINGERPRINT) == Admission({}, {})
    changed = {1: {**joins[1], "fingerprint": {**FINGERPRINT, "rl": 2}}}
    refused = membership.admissions(m, changed, attempt="a1", fingerprint=FINGERPRINT)
    assert refused.admit == {} and "rl: master 1 vs rank 1 2" in refused.refuse[1]


def test_members_keep_their_file_format(tmp_path):
    from orchestrator.protocol import fsio

    m = out(2)
    m.declare_round(3, 1)
    m.write(tmp_path / "members.json")
    raw = fsio.read_record(tmp_path / "members.json")
    assert set(raw) == {"out", "admitted", "events", "train_round"} and list(raw["out"]) == ["2"]
    back = Members.read(tmp_path / "members.json")
    assert back.out.keys() == {2} and back.round_of(3) == (1, frozenset({2}))
    assert Members.read(tmp_path / "absent.json") == Members()
