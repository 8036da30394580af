"""Who this process is, as other nodes see it."""

from __future__ import annotations

import os
import socket

import psutil

HOST_ENV = "ORCHESTRATOR_HOST"


def host() -> str:
    """This node's name; ``ORCHESTRATOR_HOST`` overrides it (containers with random hostnames)."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def process_start_time(pid: int) -> float | None:
    """When the live process ``pid`` started; None if there is none (a zombie is dead)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def me() -> dict:
    pid = os.getpid()
    return {"host": host(), "pid": pid, "pid_start": process_start_time(pid)}


def same_host_process_alive(record: dict) -> bool | None:
    """For a record naming (host, pid, pid_start): is that process alive?

    None when the record is from another host: only its heartbeat can tell.
    """
    if record.get("host") != host():
        return None
    started = process_start_time(int(record.get("pid", -1)))
    if started is None:
        return False
    want = record.get("pid_start")
    return want is None or abs(started - want) < 1.0
