"""A child process's own account of its failure, like torch elastic's ``@record``.

The rank starts each child (trainer, embedded engine) with ``ORCHESTRATOR_ERROR_FILE``
set to a path of its choosing. A child that fails writes there, once, what ended it: the
exception's type, its message and its traceback. The rank reads that record and names it
as the root cause, instead of guessing from the tail of the child's log, which is cut at
an arbitrary byte and may end with somebody else's noise. A child that dies without
writing (SIGKILL, a segfault, out of memory) leaves no record; the rank then falls back to
the log's tail.

Record (JSON, through ``fsio``'s checksum envelope; nothing pickled)::

    {"program": "trainer", "kind": "TrainerError", "message": "...", "traceback": "...",
     "exit_code": 2, "pid": 1234, "host": "node1", "at": 1763900000.0}
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from pathlib import Path

from orchestrator.protocol import fsio

log = logging.getLogger(__name__)

ENV = "ORCHESTRATOR_ERROR_FILE"
TRACEBACK_CHARS = 8000
LOG_TAIL_CHARS = 3000


def write(exc: BaseException, *, program: str, exit_code: int, env: dict | None = None) -> None:
    """Record ``exc`` as this child's failure where the parent asked (``$ORCHESTRATOR_ERROR_FILE``);
    nothing when it did not ask. Never raises: a failure to report must not hide the failure."""
    target = (os.environ if env is None else env).get(ENV)
    if not target:
        return
    body = {
        "program": program,
        "kind": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:],
        "exit_code": exit_code,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "at": time.time(),
    }
    try:
        fsio.write_record(Path(target), body)
    except OSError as e:
        log.error("could not write the error record %s: %s", target, e)


def read(path: Path) -> dict | None:
    """The record a child wrote at ``path``, or None (none written, or not a valid record)."""
    body = fsio.read_record(path)
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in ("program", "kind", "message")):
        return None
    return body


def clear(path: Path) -> None:
    """Remove a record left by an earlier start, before starting the child again."""
    path.unlink(missing_ok=True)


def explain(what: str, error_file: Path, log_file: Path, log_tail: str | None = None) -> tuple[str, dict | None]:
    """The message for a child that failed (``what``: which one, and its exit code) and its
    record: the child's own exception if it wrote one at ``error_file``, else the tail of
    ``log_file`` (``log_tail`` when the caller has read it already)."""
    record = read(error_file)
    if record is not None:
        return f"{what}: {describe(record)} (traceback in {error_file}, output in {log_file})", record
    tail = log_file.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log_tail is None else log_tail
    return f"{what} without an error record (killed?); {log_file} ends:\n{tail}", None


def describe(record: dict) -> str:
    """One line: the child's exception as it raised it."""
    return f"{record['kind']}: {record['message']}" if record["message"] else record["kind"]


def traceback_tail(record: dict, lines: int = 12) -> str:
    return "\n".join((record.get("traceback") or "").rstrip().splitlines()[-lines:])
