"""One process per rank of a run on each host: a second process of the same rank, started on
the same host, is refused at once (exit 2) before it writes anything to the run.

The claim is an ``flock`` (``filelock.FileLock``) on a file of this node's own disk, named by
the run (its resolved ``--log-path``), the host name and the rank, and held for the life of the
process. The kernel drops it when the process ends, ``kill -9`` included, so a lock file left
behind never blocks a later start: a rank restarted after it died (a new master, an elastic
rejoin) starts at once. It cannot reach across hosts (``flock`` on a shared filesystem is per
client on sshfs and FUSE, and silently local on NFS mounted ``nolock``); there the master's
lease and the heartbeats decide (``protocol/lease.py``).

Where: ``<tmp>/orchestrator-<uid>/`` (``tempfile.gettempdir()``, so ``TMPDIR`` moves it),
a directory only its user may use, so users of one host neither share nor squat on each
other's locks. Not ``$XDG_RUNTIME_DIR``: batch jobs, cron and containers often have none, and
logind deletes it at the user's last logout while a ``nohup``'d rank goes on, which would let
a second process take a fresh lock file. While a rank runs it holds a shared ``flock`` on that
directory too, which systemd-tmpfiles honours by not age-cleaning it (RHEL cleans ``/tmp``
after 10 days: a long run's lock file would go).

Each holder writes who it is beside its lock file (``<name>.json``: host, pid, start time), so
the refused process can name the pid to stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
from enum import StrEnum
from pathlib import Path

import filelock

from orchestrator.errors import BadInput
from orchestrator.node import identity


class Role(StrEnum):
    """What holds the rank: a run's rank, or `doctor` for that rank (which may run beside it)."""

    RUN = "run"
    DOCTOR = "doctor"


class RankTaken(BadInput):
    """Another live process on this host holds this rank of this run (exit 2)."""


def lock_dir() -> Path:
    """This user's directory of rank locks on this node's own disk, created private on first use."""
    path = Path(tempfile.gettempdir()) / f"orchestrator-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise BadInput(f"cannot create {path} for this node's rank locks ({e.strerror}): set TMPDIR to a directory of this "
                       f"node's own disk that this user can write") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise BadInput(f"{path} (this node's rank locks) is not a directory of this user (uid {os.getuid()}): remove it, or "
                       f"set TMPDIR to a directory of this node's own disk that only this user can write")
    return path


def lock_file(log_path: Path, rank: int, role: Role = Role.RUN, host: str | None = None) -> Path:
    """The lock of ``rank`` of the run under ``log_path`` on ``host`` (this one by default).
    Two spellings of one directory (a symlink, ``..``) name one run."""
    run = f"{Path(log_path).resolve()}\0{host or identity.host()}"
    return lock_dir() / f"{role}-r{rank}-{hashlib.sha256(run.encode()).hexdigest()[:20]}.lock"


class RankLock:
    """This process's hold on one rank of one run on this host; :func:`claim` takes it. A
    context manager that releases it (a process that ends releases it anyway)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = filelock.FileLock(path, mode=0o600, thread_local=False)
        self._directory_fd = -1

    def release(self) -> None:
        if self._lock.is_locked:
            _holder_file(self.path).unlink(missing_ok=True)  # before the lock: never the next holder's
            self._lock.release(force=True)
        if self._directory_fd >= 0:
            os.close(self._directory_fd)
            self._directory_fd = -1

    def __enter__(self) -> RankLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim(log_path: Path, rank: int, role: Role = Role.RUN) -> RankLock:
    """Hold ``rank`` of the run under ``log_path`` on this host, or raise :class:`RankTaken`
    naming the process that holds it; never waits for it. Raises BadInput when this node has
    no usable lock directory. Writes only under :func:`lock_dir`."""
    held = RankLock(lock_file(log_path, rank, role))
    try:
        held._directory_fd = os.open(held.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held._directory_fd, fcntl.LOCK_SH)  # systemd-tmpfiles skips a directory locked so
        try:
            held._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise RankTaken(_taken(log_path, rank, role, held.path)) from None
        _write_holder(held.path, {**identity.me(), "rank": rank, "role": str(role), "log_path": str(log_path)})
    except BaseException as e:
        held.release()
        if isinstance(e, OSError):
            raise BadInput(f"cannot lock {held.path} ({e.strerror or e}), this node's claim on rank {rank}: set TMPDIR to a "
                           f"directory of this node's own disk that this user can write") from None
        raise
    return held


def _holder_file(lock: Path) -> Path:
    return lock.with_suffix(".json")


def _write_holder(lock: Path, body: dict) -> None:
    """Say who holds ``lock``, for a process it refuses (atomically: a reader sees all or nothing)."""
    target = _holder_file(lock)
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(body))
    os.replace(temp, target)


def _holder(lock: Path) -> dict | None:
    """The live process that wrote itself beside ``lock``; None while the holder has not said
    yet (it took the lock a moment ago), or when what is there names a process that ended."""
    with contextlib.suppress(OSError, ValueError):
        body = json.loads(_holder_file(lock).read_text())
        if isinstance(body, dict) and identity.same_host_process_alive(body):
            return body
    return None


def _taken(log_path: Path, rank: int, role: Role, path: Path) -> str:
    holder = _holder(path)
    host = identity.host()
    who = f"pid {holder['pid']}" if holder is not None else "pid not known yet"
    stop = f"kill {holder['pid']}" if holder is not None else f"find it with: fuser {path}"
    if role is Role.DOCTOR:
        return (f"doctor for rank {rank} of --log-path {log_path} is already running on host {host} ({who}): let it "
                f"finish or stop it first ({stop}), or give this one another --worker R")
    return (f"rank {rank} of --log-path {log_path} is already running on host {host} ({who}): each rank runs once. Stop "
            f"it first ({stop}, or Ctrl+C where it runs), or start this node as another rank (--worker R)")
