"""Six ranks of a rehearsal through `orchestrator local`: every rank passes every barrier.

Runs the ranks with the barrier-latency bench's launcher (bench/barrier_latency.py), then
checks each rank's event log directly against the phase table, and that the bench's own
analysis of those logs agrees.
"""

import pytest

from bench.barrier_latency import analyze, barrier_rounds, launch, rank_events
from orchestrator.phase_table import Barrier, Phase

pytestmark = [pytest.mark.slow]

N = 6
ITERATIONS = 2


@pytest.mark.timeout(120)
def test_six_ranks_release_every_barrier(tmp_path):
    log_path = tmp_path / "run"
    run = launch(N, ITERATIONS, log_path, tmp_path, timeout_s=90)
    assert run.returncode == 0, run.tail(80)

    expected = {(i, int(p)) for i in range(1, ITERATIONS + 1) for p in Phase if p.spec.barrier is Barrier.ALL}
    assert len(expected) == 12 * ITERATIONS
    events = rank_events(log_path, N)
    for rank in range(N):
        ev = events[rank]
        arrived = {(e["iteration"], e["phase"]) for e in ev if e["event"] == "arrive"}
        released = {(e["iteration"], e["phase"]) for e in ev if e["event"] == "released"}
        assert arrived == expected, f"rank {rank} arrived at {sorted(arrived)}"
        assert released == expected, f"rank {rank} missed releases {sorted(expected - released)}"
        assert [e["state"] for e in ev if e["event"] == "end"] == ["done"]
        if rank == 0:
            assert {(e["iteration"], e["phase"]) for e in ev if e["event"] == "all_arrived"} == expected

    result = analyze(log_path, N, ITERATIONS, work_s=0.0, launch_info=run)
    assert set(barrier_rounds(ITERATIONS)) == expected
    assert result["summary"]["rounds"] == len(expected)
    assert [it["barrier_rounds"] for it in result["iterations"]] == [12] * ITERATIONS
    assert all(r["all_arrived_to_last_released_s"] >= 0 for r in result["rounds"])
