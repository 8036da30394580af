"""All user-facing output goes through here (rich), so styles and exit paths stay uniform."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

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
    """A table under its title, the title folded to the terminal's width like prose (a rich
    title is cut to the table's width, or runs off the edge under soft wrapping)."""
    if title:
        out.print(line(title))
    out.print(table(None, columns, rows))


class Prose:
    """A line of prose folded at word boundaries to the width it is drawn in (the consoles
    soft-wrap, which leaves breaking lines to the terminal, mid-word); a word longer than
    the width is folded where it must."""

    def __init__(self, text: str):
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for part in Text(self.text).wrap(console, options.max_width, overflow="fold"):
            part.rstrip()
            yield part


def line(text: str) -> Prose:
    return Prose(text)


def table_width(widths: Sequence[int]) -> int:
    """Cells a table of columns this wide takes: rich's default box and padding put a
    border and a space each side of every value."""
    return sum(widths) + 3 * len(widths) + 1


def fit_columns(widths: Sequence[int], optional: Sequence[int], width: int) -> list[int] | None:
    """The indices of the columns a table shows in ``width`` cells, each at its full width:
    every column, less the ``optional`` ones (indices, the first to go first) while the
    table is wider than that. None when even the others do not fit."""
    kept = list(range(len(widths)))
    leaving = list(optional)
    while table_width([widths[i] for i in kept]) > width:
        if not leaving:
            return None
        kept.remove(leaving.pop(0))
    return kept


class FittedTable:
    """A table that fits the width it is drawn in without cutting a header or a value.

    Columns named in ``optional`` are left out, the first named first, while the table is
    too wide (and also when they hold nothing), and a line under it names those left out;
    the other columns are never cut. When even those do not fit, each row becomes one line
    of ``header value`` pairs. The width is the console's at each draw, so a live view
    follows a resized terminal.
    """

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[object]], optional: Sequence[str] = (), *,
                 elsewhere: str = ""):
        """``elsewhere``: where the columns left out can be read (said under the table)."""
        assert set(optional) <= set(columns), f"optional columns {optional} not among {columns}"
        self.columns = list(columns)
        self.rows = [["" if v is None else str(v) for v in r] for r in rows]
        self.optional = [self.columns.index(c) for c in optional]
        self.elsewhere = elsewhere

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        empty = [i for i in self.optional if not any(r[i] for r in self.rows)]
        shown = [i for i in range(len(self.columns)) if i not in empty]
        widths = [max([cell_len(self.columns[i])] + [cell_len(r[i]) for r in self.rows]) for i in shown]
        fit = fit_columns(widths, [shown.index(i) for i in self.optional if i in shown], options.max_width)
        if fit is None:
            yield from self._stacked()
            return
        kept = [shown[k] for k in fit]
        t = Table()
        for k in fit:
            t.add_column(self.columns[shown[k]], no_wrap=True, min_width=widths[k])
        for r in self.rows:
            t.add_row(*(Text(r[i]) for i in kept))  # values are not markup: their width is what was measured
        yield t
        left_out = [self.columns[i] for i in shown if i not in kept]
        if left_out:
            yield line(f"(not shown at {options.max_width} columns: {', '.join(left_out)}"
                       f"{'; ' + self.elsewhere if self.elsewhere else ''})")

    def _stacked(self) -> RenderResult:
        head = self.columns[0]
        for r in self.rows:
            pairs = ", ".join(f"{h} {v}" for h, v in zip(self.columns[1:], r[1:]) if v)
            yield line(f"{head} {r[0]}: {pairs}" if pairs else f"{head} {r[0]}")


def _markup_ok(message: str) -> bool:
    return "[" not in message


def setup_logging(rank: int | None, host: str) -> None:
    """Rank logs go to stderr as plain lines: they are read in files and prefixed by `local`."""
    who = f"rank {rank} {host}" if rank is not None else host
    fmt = f"%(asctime)s.%(msecs)03d [{who}] %(levelname)s %(message)s"
    logging.basicConfig(level=os.environ.get("ORCHESTRATOR_LOG_LEVEL", "INFO"), format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for chatty in ("httpx", "httpcore", "httpx2", "httpcore2", "openai"):  # a line for every request in flight (an agent's too): the engine's log has them
        logging.getLogger(chatty).setLevel(logging.WARNING)


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
