"""Same-host wake-ups (coordination/wakeup.py) and the reads that a waiting or watching worker makes:
a real inotify watch, real files, real threads; timing bounds are correctness bounds only
(a wait that a wake-up ends comes long before the poll interval it would otherwise sleep)."""

import threading
import time

import pytest

from orchestrator.errors import StopRequested
from orchestrator.protocol import fsio
from orchestrator.coordination import wakeup
from orchestrator.coordination.monitor import MasterWord
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, poll

LONG_POLL_S = 20.0  # what a wait sleeps between polls here when nothing wakes it


def _later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_a_file_renamed_into_place_on_this_host_wakes_the_wait_at_once(tmp_path):
    target = tmp_path / "r00000.json"
    wake = wakeup.on_write(tmp_path, [target.name])
    assert wake is not None
    try:
        _later(0.3, lambda: fsio.write_record(target, {"released": [1, 2, 0]}, durable=False))
        began = time.monotonic()
        body = poll(lambda: fsio.read_record(target), deadline=Deadline.after(60, "the file"), cancel=CancelToken(),
                    backoff=Backoff(LONG_POLL_S, LONG_POLL_S), wake=wake.event)
        assert body == {"released": [1, 2, 0]}
        assert time.monotonic() - began < LONG_POLL_S / 4
    finally:
        wake.close()


def test_reads_and_other_names_do_not_wake_the_wait(tmp_path):
    target, other = tmp_path / "r00000.json", tmp_path / "r00001.json"
    fsio.write_record(target, {"n": 1})
    wake = wakeup.on_write(tmp_path, [target.name])
    try:
        fsio.read_record(target)
        fsio.write_record(other, {"n": 2})
        assert not wake.event.wait(1.0)
        fsio.write_record(target, {"n": 3})
        assert wake.event.wait(5.0)
    finally:
        wake.close()


def test_a_cancel_ends_a_wait_that_listens_for_wake_ups_at_once(tmp_path):
    wake = wakeup.on_write(tmp_path, ["never.json"])
    cancel = CancelToken()
    _later(0.3, lambda: cancel.cancel(StopRequested("stop")))
    began = time.monotonic()
    try:
        with pytest.raises(StopRequested):
            poll(lambda: None, deadline=Deadline.after(60, "nothing"), cancel=cancel, backoff=Backoff(LONG_POLL_S, LONG_POLL_S),
                 wake=wake.event)
        assert time.monotonic() - began < LONG_POLL_S / 4
    finally:
        wake.close()


def test_no_wake_up_for_a_directory_that_does_not_exist_the_wait_polls(tmp_path):
    assert wakeup.on_write(tmp_path / "missing", ["x"]) is None


def test_waiters_on_one_directory_share_its_watch_and_each_hears_its_own_names(tmp_path):
    a, b = wakeup.on_write(tmp_path, ["a.json"]), wakeup.on_write(tmp_path, ["b.json"])
    try:
        fsio.write_record(tmp_path / "b.json", {})
        assert b.event.wait(5.0)
        assert not a.event.is_set()
    finally:
        a.close()
        b.close()


def test_the_master_word_is_read_once_however_many_ask_within_its_age(tmp_path, monkeypatch):
    path = tmp_path / "r00000.json"
    fsio.write_record(path, {"counter": 1})
    reads = []
    real = fsio.read_record
    monkeypatch.setattr(fsio, "read_record", lambda p: (reads.append(p), real(p))[1])
    now = [0.0]
    word = MasterWord(path, clock=lambda: now[0])
    assert word.read(max_age_s=1.0) == {"counter": 1}
    now[0] = 0.5
    assert word.read(max_age_s=1.0) == {"counter": 1}  # the monitor: a barrier poll read it half a second ago
    assert len(reads) == 1
    fsio.write_record(path, {"counter": 2})
    assert word.read() == {"counter": 2} and len(reads) == 2  # a barrier poll always reads


def test_a_sweep_reads_everything_at_its_pace_and_only_what_was_heard_between(tmp_path):
    from orchestrator.protocol.clock import FakeClock
    from orchestrator.protocol.waiting import Sweep

    clock = FakeClock()
    sweep = Sweep(reads_per_s=10, clock=clock)
    name = lambda r: f"r{r}.json"  # noqa: E731
    assert sweep.pick([1, 2, 3], set(), name) == [1, 2, 3] and sweep.full
    clock.advance(0.1)
    assert sweep.pick([1, 2, 3], {"r2.json", "x"}, name) == [2] and not sweep.full
    clock.advance(0.3)  # (3 + 1) reads at 10 a second: the next sweep after 0.4 s
    assert sweep.pick([1, 3], set(), name) == [1, 3] and sweep.full


def test_wakeups_say_which_names_were_written(tmp_path):
    with wakeup.Wakeups() as wakes:
        assert wakes.watch(tmp_path, None)
        fsio.write_record(tmp_path / "a.json", {"x": 1})
        assert wakes.event.wait(5)
        deadline = time.monotonic() + 5
        heard: set[str] = set()
        while "a.json" not in heard and time.monotonic() < deadline:
            heard |= wakes.heard()
            time.sleep(0.01)
        assert "a.json" in heard
        fsio.write_record(tmp_path / "b.json", {"x": 2})
        assert wakes.event.wait(5)
        deadline = time.monotonic() + 5
        heard = set()
        while "b.json" not in heard and time.monotonic() < deadline:
            heard |= wakes.heard()
            time.sleep(0.01)
        assert "a.json" not in heard  # taken once: a name is heard again only when written again
