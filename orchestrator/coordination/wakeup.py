"""Same-host wake-ups: a rank waiting for a file that a process of its own host writes is
woken at once (inotify, through watchdog) instead of at its next poll.

A wake-up only brings the next poll forward; the poll, which opens the file by name, stays
the truth. inotify sees what this host's kernel does, never what another NFS, Lustre or FUSE
client does (docs/shared-filesystems.md), so a wait asks for one only where the writer may
be on its host (``orchestrator local``: several ranks on one node). It costs nothing on the
shared filesystem: the kernel reports the host's own renames. A wake-up that never comes
costs nothing either: the wait polls as it would without. Where inotify is refused (its
per-user limits) the wait just polls.

One watch per directory and process, shared by every waiter on it (a bench runs many ranks
in one process); each waiter names the files it waits for.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)


class Wakeup:
    """A waiter's interest in ``names`` of one directory (None: any file in it)."""

    def __init__(self, hub: "_Hub", directory: str, names: frozenset[str] | None, event: threading.Event | None = None):
        self.event = event if event is not None else threading.Event()
        self._hub = hub
        self._directory = directory
        self.names = names
        self._heard: set[str] = set()
        self._lock = threading.Lock()

    def hear(self, names: set[str]) -> None:
        with self._lock:
            self._heard |= names
        self.event.set()

    def take(self) -> set[str]:
        """The names written since the last call."""
        with self._lock:
            heard, self._heard = self._heard, set()
        return heard

    def close(self) -> None:
        self._hub.leave(self._directory, self)


class _Dir:
    """One directory's watch and the waiters on it."""

    def __init__(self) -> None:
        self.waiters: set[Wakeup] = set()
        self.watch = None

    def dispatch(self, event) -> None:
        paths = [getattr(event, "dest_path", ""), event.src_path]
        names = {os.path.basename(os.fsdecode(p)) for p in paths if p}
        for waiter in list(self.waiters):
            mine = names if waiter.names is None else names & waiter.names
            if mine:
                waiter.hear(mine)


class _Hub:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._observer = None
        self._dirs: dict[str, _Dir] = {}
        self._refused = False

    def join(self, directory: Path, names: Iterable[str] | None, event: threading.Event | None = None) -> Wakeup | None:
        key = os.path.realpath(directory)
        with self._lock:
            if self._refused:
                return None
            entry = self._dirs.get(key)
            if entry is None:
                entry = _Dir()
                try:
                    entry.watch = self._observer_started().schedule(_Handler(entry), key, event_filter=_WRITES)
                except (OSError, RuntimeError) as e:  # no such directory yet; inotify limits reached
                    if not isinstance(e, FileNotFoundError):
                        log.debug("no same-host wake-ups (%s): waits poll only", e)
                        self._refused = True
                    return None
                self._dirs[key] = entry
            waiter = Wakeup(self, key, frozenset(names) if names is not None else None, event)
            entry.waiters.add(waiter)
            return waiter

    def leave(self, key: str, waiter: Wakeup) -> None:
        with self._lock:
            entry = self._dirs.get(key)
            if entry is None:
                return
            entry.waiters.discard(waiter)
            if not entry.waiters:
                del self._dirs[key]
                try:
                    self._observer.unschedule(entry.watch)
                except (KeyError, OSError):
                    pass  # the directory went away with its watch

    def _observer_started(self):
        if self._observer is None:
            from watchdog.observers import Observer

            _no_move_pairing()
            _quiet_stopped_emitter()
            observer = Observer()
            observer.daemon = True
            observer.start()
            self._observer = observer
        return self._observer


def _no_move_pairing() -> None:
    """watchdog holds each rename's IN_MOVED_FROM for 0.5 s to pair it with its IN_MOVED_TO,
    and its queue then hands out nothing behind it until that time has passed, even once
    paired: a wake-up came up to half a second late whenever the two arrived apart (often, with
    many ranks on a few cores). A waiter needs only the name a file was renamed to, which an
    unpaired IN_MOVED_TO reports at once (as a created file)."""
    try:
        from watchdog.observers.inotify_move_event_grouper import InotifyMoveEventGrouper as Grouper
    except ImportError:  # watchdog before 7
        try:
            from watchdog.observers.inotify_buffer import InotifyBuffer as Grouper
        except ImportError:  # not Linux: no inotify
            return
    Grouper.delay = 0.0


def _quiet_stopped_emitter() -> None:
    """watchdog logs an ERROR when an event arrives for a watch just unscheduled (its emitter
    thread stopped between reading the event and queueing it): here that is a wait that
    ended, and the event is not needed. Only that message is dropped."""
    logging.getLogger("watchdog.observers.inotify").addFilter(
        lambda record: "called when the thread is inactive" not in record.getMessage())


def _writes() -> list:
    from watchdog.events import FileClosedEvent, FileCreatedEvent, FileMovedEvent

    return [FileCreatedEvent, FileMovedEvent, FileClosedEvent]  # not opens and reads: waiters read the same files


class _Handler:
    """watchdog's handler interface: every event of the directory goes to its waiters."""

    def __init__(self, entry: _Dir):
        self._entry = entry

    def dispatch(self, event) -> None:
        self._entry.dispatch(event)


_WRITES = _writes()
_HUB = _Hub()


def on_write(directory: Path, names: Iterable[str] | None = None, event: threading.Event | None = None) -> Wakeup | None:
    """Wake-ups when a file of ``names`` in ``directory`` (None: any) is created, renamed into
    place or written by a process of this host; None where none can be had (the directory does
    not exist yet, or inotify is refused). ``event``: the one to set (several wake-ups of one
    wait share it; default: a new one). ``close()`` the wake-up when the wait ends."""
    return _HUB.join(directory, names, event)


class Wakeups:
    """The wake-ups of one wait: each sets the same ``event`` (give it to ``poll``); a context
    manager that ends them all. A wait with none just polls."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._each: list[Wakeup] = []

    def watch(self, directory: Path, names: Iterable[str] | None = None) -> bool:
        """Wake on ``names`` of ``directory`` too (see :func:`on_write`); False where it cannot."""
        waiter = on_write(directory, names, self.event)
        if waiter is not None:
            self._each.append(waiter)
        return waiter is not None

    def heard(self) -> set[str]:
        """The names this wait's wake-ups saw written since the last call (a probe that reads
        many files can read just these between its full rounds)."""
        return set().union(*(waiter.take() for waiter in self._each))

    def __enter__(self) -> "Wakeups":
        return self

    def __exit__(self, *exc) -> None:
        for waiter in self._each:
            waiter.close()
        self._each.clear()
