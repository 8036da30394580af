"""Child processes of a rank (engine, trainer): started in their own process group, and
all stopped together when the rank ends, whatever the reason.

Children also get ``PR_SET_PDEATHSIG`` so that even a ``kill -9`` of the rank, which runs
no cleanup, takes them down with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Sequence

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the process-group cleanup still covers graceful exits


class Children:
    """The rank's registry of child process groups."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def start(self, argv: Sequence[str], *, env: dict | None = None, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(
            list(argv),
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        with self._lock:
            self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float = 5.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after ``grace_s``; returns its code."""
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
