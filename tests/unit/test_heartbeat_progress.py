"""What a heartbeat says of a rollout's progress: done/total, and a rate in tasks per second
counted from the phase's first progress report (after the engine start, less what a
restarted rank found in its shard), present from the first durable batch on."""

from pathlib import Path

from orchestrator.protocol import fsio
from orchestrator.coordination.heartbeat import Heartbeat


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _heartbeat(tmp_path: Path, clock: FakeClock) -> tuple[Heartbeat, Path]:
    path = tmp_path / "r00000.json"
    return Heartbeat(path, rank=0, attempt="a000001-abcdef", interval_s=5.0, clock=clock), path


def test_rate_counts_from_the_first_report_of_the_phase_not_from_its_start(tmp_path):
    clock = FakeClock()
    hb, path = _heartbeat(tmp_path, clock)
    hb.update(iteration=1, phase="1:rollout", state="working", progress=None)
    clock.now += 60.0  # the engine starts: no progress reported yet
    assert fsio.read_record(path)["progress"] is None
    hb.update(progress={"done": 0, "total": 128})
    assert fsio.read_record(path)["progress"] == {"done": 0, "total": 128, "rate": None}
    clock.now += 4.0
    hb.update(progress={"done": 16, "total": 128})  # the first durable batch
    assert fsio.read_record(path)["progress"] == {"done": 16, "total": 128, "rate": 4.0}
    clock.now += 4.0
    hb.update(progress={"done": 48, "total": 128})
    assert fsio.read_record(path)["progress"]["rate"] == 6.0


def test_a_beat_without_a_new_batch_shows_the_rate_falling(tmp_path):
    clock = FakeClock()
    hb, path = _heartbeat(tmp_path, clock)
    hb.update(iteration=1, phase="1:rollout", progress=None)
    hb.update(progress={"done": 0, "total": 64})
    clock.now += 2.0
    hb.update(progress={"done": 32, "total": 64})
    clock.now += 14.0  # the rank stalls; its heartbeat thread beats on
    hb.beat()
    assert fsio.read_record(path)["progress"] == {"done": 32, "total": 64, "rate": 2.0}


def test_tasks_a_restarted_rank_found_in_its_shard_do_not_count_toward_its_rate(tmp_path):
    clock = FakeClock()
    hb, path = _heartbeat(tmp_path, clock)
    hb.update(iteration=3, phase="1:rollout", progress=None)
    hb.update(progress={"done": 100, "total": 128})  # resumed: 100 tasks already durable
    clock.now += 1.0
    hb.beat()
    assert fsio.read_record(path)["progress"] == {"done": 100, "total": 128, "rate": None}
    clock.now += 1.0
    hb.update(progress={"done": 108, "total": 128})
    assert fsio.read_record(path)["progress"]["rate"] == 4.0


def test_the_next_phase_counts_its_rate_afresh(tmp_path):
    clock = FakeClock()
    hb, path = _heartbeat(tmp_path, clock)
    hb.update(iteration=1, phase="1:rollout", progress=None)
    hb.update(progress={"done": 0, "total": 10})
    clock.now += 1.0
    hb.update(progress={"done": 10, "total": 10})
    hb.update(iteration=1, phase="2:rollout_done", progress=None)
    assert fsio.read_record(path)["progress"] is None
    clock.now += 30.0
    hb.update(iteration=1, phase="6:eval", progress=None)
    hb.update(progress={"done": 0, "total": 8})
    clock.now += 2.0
    hb.update(progress={"done": 8, "total": 8})
    assert fsio.read_record(path)["progress"] == {"done": 8, "total": 8, "rate": 4.0}


def test_once_the_work_is_done_the_rate_stays_while_the_rank_waits_at_the_barrier(tmp_path):
    clock = FakeClock()
    hb, path = _heartbeat(tmp_path, clock)
    hb.update(iteration=1, phase="6:eval", progress=None)
    hb.update(progress={"done": 0, "total": 8})
    clock.now += 2.0
    hb.update(progress={"done": 8, "total": 8})
    hb.update(state="waiting")
    clock.now += 60.0
    hb.beat()
    assert fsio.read_record(path)["progress"] == {"done": 8, "total": 8, "rate": 4.0}
