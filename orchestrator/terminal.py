"""All user-facing output goes through here (rich), so styles and exit paths stay uniform."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from rich.console import Console
from rich.table import Table

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def display_error(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", markup=True) if _markup_ok(message) else err.print("error: " + message, markup=False)


def abort(message: str, code: int) -> NoReturn:
    display_error(message)
    sys.exit(code)


def table(title: str | None, columns: list[str], rows: list[list[object]]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    return t


def display_table(title: str | None, columns: list[str], rows: list[list[object]]) -> None:
    out.print(table(title, columns, rows))


def _markup_ok(message: str) -> bool:
    return "[" not in message


def setup_logging(rank: int | None, host: str) -> None:
    """Rank logs go to stderr as plain lines: they are read in files and prefixed by `local`."""
    who = f"rank {rank} {host}" if rank is not None else host
    fmt = f"%(asctime)s.%(msecs)03d [{who}] %(levelname)s %(message)s"
    logging.basicConfig(level=os.environ.get("ORCHESTRATOR_LOG_LEVEL", "INFO"), format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)


class _NoProgress:
    def update(self, done: int, total: int | None = None) -> None:
        pass

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Progress:
    """A rich progress bar on stderr for long work (rollout, eval)."""

    def __init__(self, description: str, total: int, done: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             console=err, transient=True)
        self._task = self._bar.add_task(description, total=total, completed=done)

    def update(self, done: int, total: int | None = None) -> None:
        self._bar.update(self._task, completed=done, total=total)

    def __enter__(self) -> "_Progress":
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()


def progress(description: str, total: int, done: int = 0):
    """A progress bar when a person watches stderr; nothing when it goes to a file or a pipe
    (rank logs, `orchestrator local`), where the heartbeat's counts serve `status` instead."""
    return _Progress(description, total, done) if err.is_terminal else _NoProgress()
