"""A --log-path this node cannot write, or a user's file it cannot read: exit 2 with one line
naming the path and what to do, no traceback, and nothing written."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REHEARSAL = ["--rehearsal", "--rl-phase", "both", "--eval-interval", "2", "--max-iterations", "1"]


def _orchestrator(*args: str, command: str = "run", unprivileged: bool = False) -> subprocess.CompletedProcess:
    """``orchestrator COMMAND ARGS``; ``unprivileged``: in a new user namespace, where this
    root process keeps its uid but loses the capability to override file permissions."""
    prefix = []
    if unprivileged:
        if subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode:
            pytest.skip("unshare --user is not permitted here")
        prefix = ["unshare", "--user"]
    return subprocess.run([*prefix, sys.executable, "-m", "orchestrator", command, *args], capture_output=True, text=True,
                          timeout=90)


def _refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def _read_only_mount(tmp_path: Path):
    """``tmp_path/ro``: a bind mount of an empty directory, remounted read-only (root only)."""
    source, target = tmp_path / "ro-source", tmp_path / "ro"
    source.mkdir()
    target.mkdir()
    if subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs root)")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_log_path_on_a_read_only_filesystem_is_refused(tmp_path):
    with _read_only_mount(tmp_path) as ro:
        line = _refused(_orchestrator("--data-path", str(tmp_path), "--log-path", str(ro / "run"), *REHEARSAL),
                        f"--log-path {ro / 'run'}", "read-only", "give a directory")
        assert line.startswith("error:")
    assert not any((tmp_path / "ro-source").iterdir())


def test_a_log_path_the_filesystem_refuses_to_create_is_refused():
    # /proc passes every permission check and still creates nothing: the mkdir itself is refused.
    _refused(_orchestrator("--data-path", "/tmp", "--log-path", "/proc/orchestrator-run", *REHEARSAL),
             "--log-path /proc/orchestrator-run cannot be created", "give a directory")
    assert not Path("/proc/orchestrator-run").exists()


def test_a_log_path_under_a_file_or_naming_a_file_is_refused(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory\n")
    _refused(_orchestrator("--data-path", str(tmp_path), "--log-path", str(a_file / "run"), *REHEARSAL),
             f"{a_file} is a file, not a directory")
    _refused(_orchestrator("--data-path", str(tmp_path), "--log-path", str(a_file), *REHEARSAL),
             f"--log-path {a_file} is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert a_file.read_text() == "not a directory\n"


def test_local_refuses_a_bad_log_path_once_before_starting_any_rank(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    proc = _orchestrator("--num-nodes", "2", "--data-path", str(tmp_path), "--log-path", str(a_file / "run"), *REHEARSAL,
                         command="local")
    _refused(proc, f"{a_file} is a file, not a directory")
    assert "[rank" not in proc.stdout


def test_a_log_path_this_user_cannot_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o555)
    _refused(_orchestrator("--data-path", str(tmp_path), "--log-path", str(shared / "exp1"), *REHEARSAL, unprivileged=True),
             f"--log-path {shared / 'exp1'}: {shared} is not writable by this user")
    assert not any(shared.iterdir())


def test_a_task_file_this_user_cannot_read_is_refused_naming_it(tmp_path):
    data = tmp_path / "data"
    (data / "model").mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("model.safetensors", ""), ("tokenizer.json", "{}")):
        (data / "model" / name).write_text(text)
    (data / "tasks").mkdir()
    (data / "tasks" / "test.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    train = data / "tasks" / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    train.chmod(0)
    log = tmp_path / "run"
    _refused(_orchestrator("--data-path", str(data), "--log-path", str(log), "--rl-phase", "both", "--eval-interval", "2",
                           unprivileged=True), f"{train}: Permission denied")
    assert not log.exists()
