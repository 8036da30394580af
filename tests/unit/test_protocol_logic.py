"""The protocol's pure decisions, driven by a fake clock: liveness, verdicts, resume point."""

import pytest

from orchestrator.phase_table import PHASE_TABLE, Barrier, Phase, RLPhase, eval_due
from orchestrator.protocol.clock import FakeClock
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.verdicts import master_verdict, worker_verdict
from orchestrator.protocol.schedule import finished, next_point, schedule
from orchestrator.protocol.schema import Progress


def hb(counter, pid=1, state="working", **kw):
    return {"counter": counter, "pid": pid, "state": state, "host": "h", "iteration": 2, "phase": "4:aggregate", **kw}


def test_rank_is_dead_only_after_its_counter_stands_still_for_the_timeout():
    clock, t = FakeClock(), LivenessTracker(timeout_s=10)
    t.observe(1, hb(1), clock.monotonic())
    clock.advance(9)
    t.observe(1, hb(1), clock.monotonic())
    assert t.dead(clock.monotonic()) == []
    clock.advance(1.5)
    assert t.dead(clock.monotonic()) == [1]
    t.observe(1, hb(2), clock.monotonic())
    assert t.dead(clock.monotonic()) == []


def test_unreadable_heartbeat_is_no_news_and_a_restarted_process_counts_as_a_change():
    clock, t = FakeClock(), LivenessTracker(timeout_s=5)
    t.observe(1, hb(7, pid=10), clock.monotonic())
    clock.advance(4)
    t.observe(1, None, clock.monotonic())
    clock.advance(2)
    assert t.dead(clock.monotonic()) == [1]
    t.observe(1, hb(7, pid=11), clock.monotonic())  # same counter, new process
    assert t.dead(clock.monotonic()) == []


def test_a_rank_that_never_beats_is_dead_after_the_timeout_and_one_that_ended_is_not():
    clock, t = FakeClock(), LivenessTracker(timeout_s=5)
    t.watch(1, clock.monotonic())
    t.observe(2, hb(3, state="done"), clock.monotonic())
    clock.advance(6)
    assert t.dead(clock.monotonic()) == [1]


def test_master_verdict_prefers_a_ranks_own_failure_record_over_a_stale_heartbeat():
    clock, t = FakeClock(), LivenessTracker(timeout_s=5)
    t.observe(2, hb(1), clock.monotonic())
    clock.advance(10)
    failure = {"host": "n1", "iteration": 2, "phase": "10:train", "kind": "error", "error": "CUDA OOM"}
    c = master_verdict({1: failure}, t, clock.monotonic(), {})
    assert (c.rank, c.kind, c.error) == (1, "error", "CUDA OOM")
    c = master_verdict({}, t, clock.monotonic(), {})
    assert (c.rank, c.kind, c.phase, c.host) == (2, "dead", "4:aggregate", "h")
    assert "died" in c.describe() and "rank 2 on host h" in c.describe()


def test_peer_reports_are_not_root_causes():
    t = LivenessTracker(timeout_s=5)
    assert master_verdict({1: {"kind": "peer", "error": "rank 0 died"}}, t, 0.0, {}) is None


def test_worker_verdict_follows_the_masters_abort_or_its_silence():
    clock, t = FakeClock(), LivenessTracker(timeout_s=5)
    t.observe(0, hb(1), clock.monotonic())
    abort = {"culprit": {"rank": 2, "host": "n2", "iteration": 1, "phase": "1:rollout", "kind": "interrupted", "error": "SIGINT"}}
    assert worker_verdict(abort, t, clock.monotonic(), {}).describe().startswith("rank 2 on host n2 was stopped by the user")
    assert worker_verdict(None, t, clock.monotonic(), {}) is None
    clock.advance(6)
    assert worker_verdict(None, t, clock.monotonic(), {}).rank == 0


@pytest.mark.parametrize("progress,expected", [
    (None, (1, Phase.SYNC_START)),
    (Progress(3, Phase.AGGREGATE, "a1"), (3, Phase.EVAL_DECIDE)),
    (Progress(3, Phase.SYNC_END, "a1"), (4, Phase.SYNC_START)),
])
def test_resume_starts_after_the_last_released_barrier(progress, expected):
    assert next_point(progress) == expected


def test_schedule_honours_rl_phase_and_max_iterations():
    both = list(schedule((1, Phase.SYNC_START), RLPhase.BOTH, 2))
    assert len(both) == 28 and both[0] == (1, Phase.SYNC_START) and both[-1] == (2, Phase.SYNC_END)
    rollout = list(schedule((1, Phase.ENGINE_STOP), RLPhase.ROLLOUT, 2))
    assert rollout == [(2, p) for p in Phase if p <= Phase.EVAL]
    update = list(schedule((1, Phase.SYNC_START), RLPhase.UPDATE, 1))
    assert update == [(1, p) for p in Phase if p >= Phase.ENGINE_STOP]
    assert list(schedule((4, Phase.SYNC_START), RLPhase.BOTH, 3)) == []


def test_a_run_is_finished_when_no_phase_is_left_under_its_configuration():
    assert not finished(None, RLPhase.BOTH, 3)
    assert not finished(Progress(3, Phase.PUBLISH, "a1"), RLPhase.BOTH, 3)
    assert finished(Progress(3, Phase.SYNC_END, "a1"), RLPhase.BOTH, 3)
    assert not finished(Progress(3, Phase.SYNC_END, "a1"), RLPhase.BOTH, 4)  # the same run, taken further
    assert not finished(Progress(3, Phase.SYNC_END, "a1"), RLPhase.BOTH, None)
    assert finished(Progress(3, Phase.EVAL, "a1"), RLPhase.ROLLOUT, 3)  # rollout mode walks no update phase


def test_eval_schedule_matches_the_spec():
    assert [i for i in range(1, 20) if eval_due(i, 6)] == [1, 7, 13, 19]
    assert all(eval_due(i, 1) for i in range(1, 5))


def test_phase_table_covers_every_phase_and_barrier_none_is_always_followed_by_a_barrier():
    assert set(PHASE_TABLE) == set(Phase)
    for p in Phase:
        if PHASE_TABLE[p].barrier is Barrier.NONE:
            assert PHASE_TABLE[Phase(p + 1)].barrier is Barrier.ALL
    assert PHASE_TABLE[Phase.SYNC_END].barrier is Barrier.ALL


def test_poll_without_a_token_ends_at_its_deadline_on_the_fake_clock():
    from orchestrator.errors import DeadlineExceeded
    from orchestrator.protocol.waiting import Backoff, Deadline, poll

    clock, probes = FakeClock(), []
    with pytest.raises(DeadlineExceeded, match="timed out waiting for x"):
        poll(lambda: probes.append(clock.monotonic()), deadline=Deadline.after(10, "x", clock), backoff=Backoff(1, 4))
    assert [round(t - probes[0], 3) for t in probes] == [0, 1, 3, 7, 10]  # 1, 2, 4, then only what is left


def test_retry_retries_only_what_it_is_told_and_never_an_interrupt():
    from orchestrator.protocol.waiting import Backoff, retry

    clock, calls = FakeClock(), []

    def flaky():
        calls.append(clock.monotonic())
        if len(calls) < 3:
            raise OSError("stale")
        return "ok"

    assert retry(flaky, what="x", attempts=4, backoff=Backoff(0.1, 1), retry_on=lambda e: isinstance(e, OSError), clock=clock) == "ok"
    assert [round(t - calls[0], 3) for t in calls] == [0, 0.1, 0.3]
    calls.clear()
    with pytest.raises(OSError):  # the last failure is raised once the tries are spent
        retry(flaky, what="x", attempts=2, backoff=Backoff(0, 0), retry_on=lambda e: True, clock=clock)
    assert len(calls) == 2
    calls.clear()

    def interrupted():
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        retry(interrupted, what="x", attempts=5, backoff=Backoff(0, 0), retry_on=lambda e: True, clock=clock)
    assert calls == [1]


def test_a_failure_from_a_reset_or_refused_connection_waits_for_a_dying_child_to_be_reaped():
    """An engine killed with SIGKILL resets its connections before the kernel reports it
    gone: the rank waits a moment for the child's death before it names the cause."""
    import urllib.error

    from orchestrator.engine.client import EngineUnavailable
    from orchestrator.runtime.runner import _lost_connection

    def raised_from(cause):
        try:
            try:
                raise cause
            except Exception as e:
                raise EngineUnavailable("cannot reach the engine") from e
        except EngineUnavailable as e:
            return e

    assert _lost_connection(raised_from(urllib.error.URLError(ConnectionResetError(104, "Connection reset by peer"))))
    assert _lost_connection(raised_from(ConnectionRefusedError(111, "Connection refused")))
    assert not _lost_connection(raised_from(urllib.error.URLError(TimeoutError("timed out"))))
    assert not _lost_connection(ValueError("a reward function's bug"))


def test_a_master_whose_workers_gave_up_on_it_is_the_root_cause_it_never_waits_for_them():
    t = LivenessTracker(timeout_s=5)
    gave_up = {"kind": "peer", "error": "rank 0 died", "culprit": {"rank": 0, "host": "n0", "iteration": 2, "phase": "1:rollout",
                                                                   "kind": "dead", "error": "no heartbeat for 6.2 s"}}
    c = master_verdict({1: gave_up, 2: gave_up}, t, 0.0, {})
    assert (c.rank, c.kind, c.iteration, c.phase, c.host) == (0, "dead", 2, "1:rollout", "n0")
    assert "rank(s) 1,2 gave up on it" in c.error and "frozen or paused" in c.error
    # a report of another rank's failure (the abort relayed) is still no root cause
    other = {**gave_up, "culprit": {**gave_up["culprit"], "rank": 2, "kind": "error"}}
    assert master_verdict({1: other}, t, 0.0, {}) is None
    # a rank's own failure comes first
    own = {"host": "n2", "iteration": 2, "phase": "1:rollout", "kind": "error", "error": "boom"}
    assert master_verdict({1: gave_up, 2: own}, t, 0.0, {}).rank == 2


def _verdict_latency(death: float, reads_from: float, interval: float = 5.0, timeout: float = 20.0, watch: float = 1.0) -> float:
    """Simulated on the fake clock: a peer beats every interval and dies at ``death``; the
    master reads heartbeats once an interval from ``reads_from`` and judges every poll; a
    worker reads the master's heartbeat (and so its abort) one watch interval later at most.
    Returns how long after the death every rank knows."""
    from orchestrator.protocol.verdicts import poll_interval_s

    poll_s = poll_interval_s(interval)
    clock, t = FakeClock(start=0.0), LivenessTracker(timeout_s=timeout)
    t.watch(1, 0.0)
    next_read = reads_from
    while not t.dead(clock.monotonic()):
        now = clock.monotonic()
        if now >= next_read:
            t.observe(1, hb(int(min(now, death) // interval)), now)
            next_read += interval
        clock.advance(poll_s)
    return clock.monotonic() + watch - death


def _master_death_latency(death: float, reads_from: float, interval: float = 5.0, timeout: float = 20.0, watch: float = 1.0) -> float:
    """A worker reads the master's heartbeat every watch interval from ``reads_from``: how long
    after the master's death the worker calls it dead."""
    clock, t = FakeClock(start=0.0), LivenessTracker(timeout_s=timeout)
    t.watch(0, 0.0)
    now = reads_from
    clock.advance(reads_from)
    while True:
        now = clock.monotonic()
        t.observe(0, hb(int(min(now, death) // interval)), now)
        if t.dead(now):
            return now - death
        clock.advance(watch)


@pytest.mark.parametrize("death", [20.01, 21.3, 22.49, 24.99])
@pytest.mark.parametrize("reads_from", [0.0, 0.1, 1.2, 2.4, 4.9])
def test_a_rank_that_sees_a_death_first_waits_long_enough_for_the_verdict(death, reads_from):
    from orchestrator.protocol.verdicts import verdict_bound_s

    assert 0 < _verdict_latency(death, reads_from) <= verdict_bound_s(20.0, 5.0, 1.0)
    assert 0 < _master_death_latency(death, reads_from % 1.0) <= verdict_bound_s(20.0, 5.0, 1.0)
    # the master names a dead worker within the node timeout plus two heartbeats
    assert _verdict_latency(death, reads_from, watch=0.0) <= 20.0 + 2 * 5.0


def test_the_node_timeout_alone_is_too_short_a_wait_for_the_verdict():
    """A death just after a beat, read late: the verdict comes after the node timeout (why a
    trainer that lost its peer named itself as the root cause)."""
    assert _verdict_latency(20.01, 4.9) > 20.0


def test_the_verdict_bound_is_the_node_timeout_plus_a_heartbeat_a_poll_and_a_watch_interval():
    from orchestrator.protocol.verdicts import verdict_bound_s

    assert verdict_bound_s(20, 5, 1) == 20 + 5 + 0.25 + 1
    assert verdict_bound_s(3, 0.2, 1) == 3 + 1 + 1  # a watch interval longer than a heartbeat's
    assert verdict_bound_s(20, 5, 1, fan_in=True) == 20 + 5 + 2.5 + 0.25 + 1  # through a leader, group files read twice an interval
