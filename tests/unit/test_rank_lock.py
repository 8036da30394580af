"""The rank lock: which file names a rank of a run on this host, who is refused, and where the
files live (the system test starts real processes: tests/system/test_rank_started_twice.py)."""

import os
import stat
import tempfile

import pytest

from orchestrator.errors import EXIT_BAD_INPUT, BadInput
from orchestrator.node import rank_lock
from orchestrator.node.rank_lock import Role


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def test_one_run_spelled_two_ways_has_one_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert rank_lock.lock_file(tmp_path / "link" / "run", 1) == rank_lock.lock_file(tmp_path / "real" / "x" / ".." / "run", 1)


def test_each_rank_role_host_and_run_has_its_own_lock(tmp_path):
    run = tmp_path / "run"
    names = {rank_lock.lock_file(run, 1), rank_lock.lock_file(run, 2), rank_lock.lock_file(run, 1, Role.DOCTOR),
             rank_lock.lock_file(run, 1, host="node-b"), rank_lock.lock_file(tmp_path / "other", 1)}
    assert len(names) == 5


def test_the_locks_live_in_a_directory_of_this_user_only(tmp_path, private_tmp):
    path = rank_lock.lock_file(tmp_path / "run", 0)
    assert path.parent == private_tmp / f"orchestrator-{os.getuid()}"
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0


def test_a_held_rank_is_refused_at_once_naming_rank_host_and_pid(tmp_path):
    with rank_lock.claim(tmp_path / "run", 1) as held:
        with pytest.raises(rank_lock.RankTaken) as refused:
            rank_lock.claim(tmp_path / "run", 1)
        assert held.path.with_suffix(".json").exists(), "the refused process leaves the holder's files alone"
        rank_lock.claim(tmp_path / "run", 2).release()  # another rank of the run
        rank_lock.claim(tmp_path / "run", 1, Role.DOCTOR).release()  # its doctor may run beside it
    assert refused.value.exit_code == EXIT_BAD_INPUT
    message = str(refused.value)
    assert f"rank 1 of --log-path {tmp_path / 'run'} is already running on host " in message
    assert f"(pid {os.getpid()})" in message and "--worker R" in message


def test_a_released_rank_is_taken_again_and_its_holder_file_goes(tmp_path):
    held = rank_lock.claim(tmp_path / "run", 1)
    holder = held.path.with_suffix(".json")
    assert holder.exists()
    held.release()
    assert held.path.exists() and not holder.exists()  # the lock file stays: unlinking it would split waiters
    rank_lock.claim(tmp_path / "run", 1).release()


def test_a_holder_file_of_a_process_that_ended_names_no_pid(tmp_path):
    with rank_lock.claim(tmp_path / "run", 1) as held:
        held.path.with_suffix(".json").write_text('{"host": "elsewhere", "pid": 1, "pid_start": 0}')
        with pytest.raises(rank_lock.RankTaken, match="pid not known yet"):
            rank_lock.claim(tmp_path / "run", 1)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_lock_directory_of_another_user_is_refused(tmp_path, private_tmp):
    squatted = private_tmp / f"orchestrator-{os.getuid()}"
    squatted.mkdir()
    os.chown(squatted, 12345, 12345)
    with pytest.raises(BadInput, match="is not a directory of this user"):
        rank_lock.claim(tmp_path / "run", 1)
