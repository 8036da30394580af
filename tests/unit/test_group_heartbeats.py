"""Heartbeats that fan in (coordination.fan_in): a group's leader passes its members'
heartbeats on in one file, and the master reads the group files instead of a file per rank,
falling back to the ranks' own files where a group's file is missing, stands still, or was
written by a rank that no longer leads the group. Real files, the monitor's own reads."""

from orchestrator.protocol import fsio
from orchestrator.protocol.barrier import FanIn
from orchestrator.coordination.heartbeat import Heartbeat
from orchestrator.protocol.layout import RunLayout
from orchestrator.coordination.monitor import Monitor
from orchestrator.protocol.waiting import CancelToken

HB = 1.0


def monitor(tmp_path, rank, num_nodes=7, fan_in=3):
    attempt = RunLayout(tmp_path / "run").attempt("a1")
    m = Monitor(attempt=attempt, rank=rank, cancel=CancelToken(), heartbeat_interval_s=HB, node_timeout_s=10,
                watch_interval_s=0.5, hosts={}, on_cancel=lambda: None)
    m.fan_in = FanIn.of(num_nodes, fan_in)
    return m, attempt


def beat(attempt, rank, counter):
    fsio.write_record(attempt.heartbeat(rank), {"pid": 100 + rank, "counter": counter, "state": "working", "rank": rank},
                      durable=False)


def test_a_leader_passes_its_members_heartbeats_and_its_own_on_in_one_file(tmp_path):
    leader, attempt = monitor(tmp_path, rank=4)
    leader.heartbeat = Heartbeat(attempt.heartbeat(4), rank=4, attempt="a1", interval_s=HB)
    leader.heartbeat.beat()
    leader.leads = lambda: 1
    beat(attempt, 5, 7)  # rank 6 has no heartbeat yet: left out, the master reads it by name
    leader._pass_heartbeats_on()
    record = fsio.read_record(attempt.group_heartbeat(1))
    assert record["leader"] == 4 and record["counter"] == 1
    assert record["beats"]["5"]["counter"] == 7 and record["beats"]["4"]["rank"] == 4 and "6" not in record["beats"]
    leader.leads = lambda: None  # no longer leads: writes nothing
    leader._pass_heartbeats_on()
    assert fsio.read_record(attempt.group_heartbeat(1))["counter"] == 1


def test_the_master_reads_group_files_and_by_name_only_what_they_do_not_carry(tmp_path):
    master, attempt = monitor(tmp_path, rank=0)
    master.watch(range(1, 7))
    fsio.write_record(attempt.group_heartbeat(0), {"leader": 1, "pid": 1, "counter": 1,
                                                   "beats": {"1": {"pid": 101, "counter": 3}, "2": {"pid": 102, "counter": 3}}})
    for r in range(1, 7):
        beat(attempt, r, 50)  # what a read by name would see
    assert master._read_groups(now=0.0, watched=master.tracker.watched()) == [3, 4, 5, 6]  # rank 3 not in group 0's file; group 1 has none
    assert master.tracker.last(1)["counter"] == 3 and master.tracker.last(3) is None


def test_a_group_file_standing_still_or_written_by_a_lost_leader_sends_the_master_to_the_ranks_files(tmp_path):
    master, attempt = monitor(tmp_path, rank=0, num_nodes=4, fan_in=3)
    master.watch([1, 2, 3])
    path = attempt.group_heartbeat(0)
    fsio.write_record(path, {"leader": 1, "pid": 1, "counter": 1, "beats": {str(r): {"pid": 100 + r, "counter": 1} for r in (1, 2, 3)}})
    assert master._read_groups(0.0, [1, 2, 3]) == []
    assert master._read_groups(1.5, [1, 2, 3]) == []  # standing still for less than two intervals
    assert master._read_groups(2.5, [1, 2, 3]) == [1, 2, 3]  # its leader died or froze: every rank by name
    fsio.write_record(path, {"leader": 1, "pid": 1, "counter": 2, "beats": {str(r): {"pid": 100 + r, "counter": 2} for r in (1, 2, 3)}})
    assert master._read_groups(3.0, [1, 2, 3]) == []
    master.forget(1)  # the run went on without rank 1: rank 2 leads its group now
    assert master._read_groups(3.5, [2, 3]) == [2, 3]  # the file is still rank 1's
    fsio.write_record(path, {"leader": 2, "pid": 2, "counter": 1, "beats": {str(r): {"pid": 100 + r, "counter": 3} for r in (2, 3)}})
    assert master._read_groups(4.0, [2, 3]) == []


def test_a_dead_member_is_named_through_its_leader_within_the_bound(tmp_path):
    master, attempt = monitor(tmp_path, rank=0, num_nodes=3, fan_in=2)
    master.watch([1, 2])
    path = attempt.group_heartbeat(0)
    for t in range(0, 30):  # the leader passes on every interval; rank 2's counter stops at 4
        fsio.write_record(path, {"leader": 1, "pid": 1, "counter": t, "beats": {"1": {"pid": 101, "counter": t},
                                                                                    "2": {"pid": 102, "counter": min(t, 4)}}})
        master._read_heartbeats(float(t))
        if master.tracker.dead(float(t)):
            break
    assert master.tracker.dead(float(t)) == [2] and t == 15  # seen to stop at t=4, dead 10 s (node timeout) later
