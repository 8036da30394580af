"""Child processes of a rank (engine, trainer): started in their own process group, and
all stopped together when the rank ends, whatever the reason.

Children also get ``PR_SET_PDEATHSIG`` so that even a ``kill -9`` of the rank, which runs
no cleanup, takes them down with it. It is set by a few lines of Python that then exec the
child (the signal survives exec), not by a ``preexec_fn``: that runs Python between fork and
exec, which can deadlock in a process with threads (the CPython docs warn), and a rank
always has threads (heartbeat, monitor).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

log = logging.getLogger(__name__)

# argv: <rank pid> <program> <args...>. Set the death signal, make sure the rank did not die
# before it was set (then the child would be orphaned already), become the program.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except OSError:
    pass  # no glibc: the process-group cleanup still covers graceful exits
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _dying_with_this_process(argv: Sequence[str]) -> list[str]:
    """``argv`` started so that it gets SIGKILL when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


WATCH_INTERVAL_S = 0.2


class Children:
    """The rank's registry of child process groups.

    A child that must stay up between phases (a persistent trainer, a serving engine) is
    ``watch``ed: if it exits before the rank stops it, a watcher thread calls its ``on_exit``
    within ``WATCH_INTERVAL_S`` (the rank cancels itself, naming the child), rather than the
    loss surfacing at the next phase that needs it, or never."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._watched: dict[subprocess.Popen, Callable[[int], None]] = {}
        self._watcher: threading.Thread | None = None

    def watch(self, proc: subprocess.Popen, on_exit: Callable[[int], None]) -> None:
        """Call ``on_exit(returncode)`` (from the watcher thread) once ``proc`` exits unless it
        is stopped or unwatched first."""
        with self._lock:
            self._watched[proc] = on_exit
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch_loop, name="children-watch", daemon=True)
                self._watcher.start()

    def unwatch(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._watched.pop(proc, None)

    def _watch_loop(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            with self._lock:
                if not self._watched:
                    self._watcher = None
                    return
            self.reap()

    def reap(self, settle_s: float = 0.0) -> None:
        """Call ``on_exit`` for every watched child that has exited, now (the watcher does it
        every ``WATCH_INTERVAL_S``; a rank that fails calls it first, so that an error caused
        by a dead child, a refused connection say, is reported as that child's death).
        ``settle_s``: wait up to that long for one to exit: a killed child's sockets close
        before the kernel reports it gone, so its peer can see the reset first."""
        deadline = time.monotonic() + settle_s
        while True:
            with self._lock:
                ended = [(p, cb) for p, cb in self._watched.items() if p.poll() is not None]
                for p, _ in ended:
                    del self._watched[p]
            if ended or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        for p, on_exit in ended:
            try:
                on_exit(p.returncode)
            except Exception:  # noqa: BLE001 - a callback must not end the watcher
                log.exception("child pid %d: on_exit failed", p.pid)

    def start(self, argv: Sequence[str], *, env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in its own process group; raises FileNotFoundError, as Popen would,
        when the program does not exist."""
        path = (env or os.environ).get("PATH", os.defpath)
        if shutil.which(argv[0], path=path) is None:
            raise FileNotFoundError(f"no program {argv[0]!r} (PATH={path})")
        proc = subprocess.Popen(_dying_with_this_process(argv), env=env, start_new_session=True, **kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float = 5.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after ``grace_s``; returns its code."""
        self.unwatch(proc)
        _signal_group(proc, signal.SIGTERM)
        try:
            code = proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            code = proc.wait(timeout=grace_s)
        # The leader is gone; anything it left in its group goes too.
        _signal_group(proc, signal.SIGKILL)
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)
        return code

    def stop_all(self, grace_s: float = 5.0) -> None:
        with self._lock:
            procs = list(self._procs)
            self._watched.clear()
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        end = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.error("child pid %d did not exit after SIGKILL", proc.pid)
        with self._lock:
            self._procs.clear()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
