"""A fault-injecting pass-through FUSE filesystem for tests (issue 6).

Each mount is its own process and its own "client": give every rank a mount of one backing
directory, each with its own faults, and the ranks see each other through the backing
directory the way nodes see each other through a file server.

    python -m tests.faultfs BACKING MOUNTPOINT --control CONTROL.json [--stats STATS.json]

runs in the foreground until unmounted (``fusermount3 -u MOUNTPOINT``) or sent SIGTERM.
Tests use :class:`FaultMount` (a context manager) or the ``faultfs_mounts`` fixture
(tests/faultfs_fixtures.py) instead.

Faults
------
The control file is JSON, re-read whenever it changes (one ``stat`` per filesystem call,
compared by inode, size and mtime; :meth:`FaultMount.set_faults` replaces it atomically,
so the next call through the mount sees the new faults). A missing file means no faults; an
invalid one keeps the previous faults (and says so on stderr). Schema::

    {"rules": [
      {"glob": "attempts/*/arrivals/*", "delay_new_s": 1.5},
      {"glob": "attempts/*/release.json", "stale_replace_s": 1.0},
      {"glob": "attempts/*/heartbeats/*", "estale": {"count": 3}},
      {"glob": "attempts/*/release.json", "estale": {"probability": 0.2, "seed": 7}},
      {"glob": "iterations/*/rollout/*/*.jsonl", "enospc_after_bytes": 4096},
      {"glob": "**", "truncate_once": {"reads": 1, "fraction": 0.5}}
    ]}

``glob`` is relative to the mount root: ``*`` and ``?`` stay within one path segment, ``**``
spans any number of segments (``**/x`` also matches ``x``); default ``**``. A rule may carry
several faults. Per-rule state (counters, the random stream, bytes written) lives as long
as the rule's JSON is unchanged: rewriting the control file with an identical rule keeps
counting, a changed rule (e.g. a new ``"id"``) starts afresh.

``delay_new_s``
    A name that this mount did not create itself (created by another mount or directly in
    the backing directory) is invisible through this mount (lookup/stat/open: ENOENT;
    readdir: left out) until ``delay_new_s`` after the name appeared: its inode's ctime (a
    rename sets it), or, when a faultfs mount replaced the name (rename over), the time the
    name first appeared, carried to the new inode in the ``user.faultfs.appeared`` xattr, so
    that a name replaced more often than the delay (a heartbeat) shows up in time, whenever
    a mount first looks (without user xattrs on the backing filesystem, a replaced name
    dates from the replacement this mount first saw). Once seen, a name stays
    visible while it exists; replacing it (rename over) does not hide it again, and an
    ``EEXIST`` from this mount's own mkdir or
    exclusive create makes it visible at once (the server said it exists). Like NFS's
    entry/negative-entry cache, with one difference: the delay counts from the file's
    appearance, not from this client's last look at the directory.
``stale_replace_s``
    A read-only open of a name remembers the inode it got for ``stale_replace_s``; while that
    memory is fresh, opens (and stat) of the name keep getting that inode even after another
    client replaced the name (rename over): old content, as from an NFS attribute cache.
    Writes, renames and unlinks through this mount forget it. A name that stops existing is
    forgotten too (ENOENT wins).
``estale``
    ``{"count": n}``: the next n opens (and directory opens) of matching existing paths fail
    with ESTALE; ``{"probability": p, "seed": s}``: each does with probability p (a seeded
    stream; ``count``, if also given, caps the total); ``"per_path": true`` makes ``count``
    apply to each path separately. A bare integer means ``{"count": n}``.
``enospc_after_bytes``
    Writes to matching paths count their bytes; once a write would take the total past the
    budget, it writes what still fits (a short write) and every later write to a matching
    path fails with ENOSPC. ``statfs`` reports the budget's remainder as free space. Lift it
    by removing the rule (or raise it by changing the number, which also restarts the count).
``truncate_once``
    ``{"reads": n, "fraction": f, "per": "version"|"path", "count": total}``: the first n
    read-only opens of each matching file version (path, inode, size, mtime; or per path)
    see only the first ``int(size * f)`` bytes, then EOF (``fstat`` still shows the whole
    size: the kernel asks for it by path, not by handle). Defaults: 1
    read, fraction 0.5, per version, no total cap. ``true`` means the defaults.

Statistics (counts, the wall time of the first and last injection per kind, the latest
injections as ``[time, kind, path]``, a hidden name only the first time, and the bytes read
through the mount per path: ``read_bytes``, as the page cache does not hide them under
``direct_io``) go to the stats
file, rewritten atomically within ~50 ms of a change: see :meth:`FaultMount.stats`.

The kernel retries an ``open()`` that fails with ESTALE once, with a fresh lookup
(``LOOKUP_REVAL``), as it does on NFS: a process sees ESTALE only when two opens in a row
fail, so ``{"count": 1}`` is absorbed by the kernel and ``{"count": 2}`` reaches the caller
once.

FUSE options, and why
---------------------
``entry_timeout=0``, ``negative_timeout=0``, ``attr_timeout=0``: the kernel caches no
lookups, negative lookups or attributes, so every lookup and stat reaches this process. The
only staleness a mount has is the one configured here, and hiding a name or lifting the
delay takes effect on the next call. ``direct_io``: reads and writes bypass the page cache,
so every ``read()`` reaches this process (a truncated or stale read is served as configured
and not masked, or unmasked, by cached pages), and every ``write()`` is counted against the
ENOSPC budget when it happens rather than at writeback. (Shared writable mmap does not work
with ``direct_io``; the rehearsal does not use mmap.) ``hard_remove``: unlinking an open file
unlinks it at once instead of renaming it to ``.fuse_hidden*`` (handles here are backing
file descriptors, which stay valid). ``use_ino``: stat shows the backing inode numbers.
No ``default_permissions`` and no ``allow_other``: the tests run as one user.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import stat as stat_mod
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.sshfs import is_mounted

log = logging.getLogger("faultfs")

FUSE_DEVICE = Path("/dev/fuse")
MOUNT_DEADLINE_S = 15.0
UNMOUNT_DEADLINE_S = 3.0
STATS_EVERY_S = 0.05
KINDS = ("hidden", "stale", "estale", "enospc", "truncated")
EVENTS_KEPT = 500


# -- globs and rules (pure) ----------------------------------------------------------------

def compile_glob(pattern: str) -> re.Pattern:
    """A path glob relative to the mount root: ``*``/``?`` within a segment, ``**`` across."""
    pattern = pattern.strip("/")
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1:end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass
class Rule:
    """One rule of the control file and its running state."""

    spec: dict
    glob: re.Pattern
    delay_new_s: float | None = None
    stale_replace_s: float | None = None
    estale: dict | None = None
    enospc_after_bytes: int | None = None
    truncate: dict | None = None
    # state
    written: int = 0
    estale_fired: int = 0
    estale_per_path: dict = field(default_factory=dict)
    truncated_fired: int = 0
    truncate_seen: dict = field(default_factory=dict)
    rng: random.Random | None = None

    def matches(self, rel: str) -> bool:
        return self.glob.match(rel) is not None


_RULE_KEYS = {"glob", "id", "delay_new_s", "stale_replace_s", "estale", "enospc_after_bytes", "truncate_once"}


def parse_rules(doc: Any) -> list[Rule]:
    """The control document's rules; raises ValueError on anything malformed."""
    if doc is None:
        return []
    if not isinstance(doc, dict) or not isinstance(doc.get("rules", []), list):
        raise ValueError('the control file must be {"rules": [...]}')
    rules = []
    for spec in doc.get("rules", []):
        if not isinstance(spec, dict):
            raise ValueError(f"a rule must be an object, not {spec!r}")
        unknown = set(spec) - _RULE_KEYS
        if unknown:
            raise ValueError(f"unknown rule keys {sorted(unknown)}; valid: {sorted(_RULE_KEYS)}")
        r = Rule(spec=spec, glob=compile_glob(str(spec.get("glob", "**"))))
        if spec.get("delay_new_s") is not None:
            r.delay_new_s = float(spec["delay_new_s"])
        if spec.get("stale_replace_s") is not None:
            r.stale_replace_s = float(spec["stale_replace_s"])
        e = spec.get("estale")
        if e is not None and e is not False:
            e = {"count": int(e)} if isinstance(e, int) and not isinstance(e, bool) else dict(e) if isinstance(e, dict) else None
            if e is None or not ({"count", "probability"} & set(e)):
                raise ValueError(f"estale needs a count or a probability: {spec['estale']!r}")
            r.estale = e
            if "probability" in e:
                r.rng = random.Random(e.get("seed", 0))
        if spec.get("enospc_after_bytes") is not None:
            r.enospc_after_bytes = int(spec["enospc_after_bytes"])
        t = spec.get("truncate_once")
        if t is not None and t is not False:
            t = {} if t is True else dict(t)
            t.setdefault("reads", 1)
            t.setdefault("fraction", 0.5)
            t.setdefault("per", "version")
            if t["per"] not in ("version", "path") or not 0 <= float(t["fraction"]) < 1:
                raise ValueError(f"truncate_once needs per in (version, path) and 0 <= fraction < 1: {spec['truncate_once']!r}")
            r.truncate = t
        rules.append(r)
    return rules


def _rule_key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


# -- the filesystem ---------------------------------------------------------------------------

# When a name first appeared, carried from inode to inode when the name is replaced through
# any faultfs mount (rename over), so every mount dates a name alike, whenever it first looks.
APPEARED_XATTR = "user.faultfs.appeared"


def _appeared(full: str, st: os.stat_result) -> float:
    """When the name ``full`` first appeared: the stamp its inode carries, else its ctime."""
    try:
        return float(os.getxattr(full, APPEARED_XATTR, follow_symlinks=False))
    except (OSError, ValueError):
        return st.st_ctime


def _carry_appeared(source: str, target: str) -> None:
    """Before ``source`` replaces ``target``: stamp ``source`` with when ``target``'s name appeared."""
    try:
        st = os.lstat(target)
    except OSError:
        return  # a new name: its appearance is the rename, which sets the ctime
    if not stat_mod.S_ISREG(st.st_mode):
        return
    try:
        os.setxattr(source, APPEARED_XATTR, repr(_appeared(target, st)).encode(), follow_symlinks=False)
    except OSError:
        pass  # no user xattrs on the backing filesystem: the name dates from the replacement


@dataclass
class Handle:
    rel: str
    cut: int | None = None  # truncated view: EOF after this many bytes


@dataclass
class Cached:
    fd: int
    ino: int
    filled: float  # monotonic


class FaultFS:
    """mfusepy operations: a pass-through of ``backing`` with the faults of ``control``.

    Not a subclass of ``mfusepy.Operations`` on purpose: mfusepy registers only the
    callbacks an object has, and this module must import without mfusepy (for the skip).
    """

    use_ns = True  # utimens and stat times in nanoseconds

    def __init__(self, backing: Path, control: Path, stats: Path | None):
        self.backing = str(Path(backing).resolve())
        self.control = Path(control)
        self.stats_path = Path(stats) if stats else None
        self._lock = threading.RLock()
        self.rules: list[Rule] = []
        self._rule_state: dict[str, Rule] = {}
        self._control_sig: tuple | None = ()
        self.own: set[str] = set()  # names this mount created (visible at once)
        self.visible: set[str] = set()  # names seen visible (stay so while they exist)
        self.appeared: dict[str, float] = {}  # hidden names: when they appeared (wall time)
        self.cache: dict[str, Cached] = {}  # stale_replace_s
        self.handles: dict[int, Handle] = {}
        self.counts = {k: 0 for k in KINDS}
        self.first_at: dict[str, float] = {}
        self.last_at: dict[str, float] = {}
        self.loads = 0
        self.read_bytes: dict[str, int] = {}  # path -> bytes read through this mount
        self.control_error: str | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._logged_hidden: set[str] = set()
        self.events: list[tuple[float, str, str]] = []  # (wall time, kind, path), the latest EVENTS_KEPT
        self._reload()
        self._write_stats()
        self._stats_thread = threading.Thread(target=self._stats_loop, name="faultfs-stats", daemon=True)
        self._stats_thread.start()

    # -- control and stats -----------------------------------------------------------------

    def _reload(self) -> None:
        try:
            st = os.stat(self.control)
            sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            sig = None
        if sig == self._control_sig:
            return
        with self._lock:
            if sig == self._control_sig:
                return
            self._control_sig = sig
            try:
                doc = json.loads(self.control.read_text()) if sig is not None else None
                rules = parse_rules(doc)
            except (OSError, ValueError, TypeError) as e:
                self.control_error = f"{type(e).__name__}: {e}"
                log.error("faultfs: ignoring invalid control file %s (keeping the previous faults): %s", self.control, e)
                self._dirty.set()
                return
            old, self._rule_state = self._rule_state, {}
            for r in rules:  # an unchanged rule keeps its state; identical rules count once
                key = _rule_key(r.spec)
                if key not in self._rule_state:
                    self._rule_state[key] = old.get(key) or r
            self.rules = list(self._rule_state.values())
            self.control_error = None
            self.loads += 1
            self._dirty.set()
            log.info("faultfs: control loaded (%d rule(s)): %s", len(self.rules), [r.spec for r in self.rules])

    def _fired(self, kind: str, rel: str, detail: str = "") -> None:
        now = time.time()
        first_hidden = kind == "hidden" and rel not in self._logged_hidden
        with self._lock:
            self.counts[kind] += 1
            self.first_at.setdefault(kind, now)
            self.last_at[kind] = now
            if kind != "hidden" or first_hidden:  # a hidden name is polled often: once is news
                self._logged_hidden.add(rel)
                self.events.append((now, kind, rel))
                del self.events[:-EVENTS_KEPT]
        self._dirty.set()
        if kind != "hidden" or first_hidden:
            log.warning("faultfs: %s %s %s", kind, rel, detail)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "pid": os.getpid(),
                "loads": self.loads,
                "control_error": self.control_error,
                "rules": [r.spec for r in self.rules],
                "counts": dict(self.counts),
                "first_at": dict(self.first_at),
                "last_at": dict(self.last_at),
                "events": [list(e) for e in self.events],
                "written": {r.spec.get("glob", "**"): r.written for r in self.rules if r.enospc_after_bytes is not None},
                "read_bytes": dict(self.read_bytes),
                "at": time.time(),
            }

    def _write_stats(self) -> None:
        if self.stats_path is None:
            return
        data = json.dumps(self.snapshot(), sort_keys=True).encode()
        tmp = self.stats_path.with_name(f".{self.stats_path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.stats_path)
        except OSError as e:
            log.error("faultfs: could not write stats %s: %s", self.stats_path, e)

    def _stats_loop(self) -> None:
        while not self._stop.is_set():
            if self._dirty.wait(0.5):
                self._dirty.clear()
                self._write_stats()
                self._stop.wait(STATS_EVERY_S)
            self._sweep_cache()

    def _sweep_cache(self) -> None:
        """Close stale-content handles past their time; forget hidden names that are gone."""
        now = time.monotonic()
        with self._lock:
            for rel, c in list(self.cache.items()):
                limit = self._stale_s(rel)
                if limit is None or now - c.filled >= limit:
                    self._forget(rel)
            hidden = list(self.appeared)
        gone = [rel for rel in hidden if not os.path.lexists(self._full("/" + rel))]
        with self._lock:
            for rel in gone:
                self.appeared.pop(rel, None)

    # -- helpers --------------------------------------------------------------------------

    def _full(self, path: str) -> str:
        return self.backing + path if path != "/" else self.backing

    @staticmethod
    def _rel(path: str) -> str:
        return path.strip("/")

    def _matching(self, rel: str, attr: str) -> list[Rule]:
        return [r for r in self.rules if getattr(r, attr) is not None and r.matches(rel)]

    def _delay_s(self, rel: str) -> float | None:
        delays = [r.delay_new_s for r in self._matching(rel, "delay_new_s")]
        return max(delays) if delays else None

    def _stale_s(self, rel: str) -> float | None:
        s = [r.stale_replace_s for r in self._matching(rel, "stale_replace_s")]
        return max(s) if s else None

    def _forget(self, rel: str) -> None:
        c = self.cache.pop(rel, None)
        if c is not None:
            os.close(c.fd)

    def _lstat(self, path: str) -> os.stat_result:
        """The backing lstat of ``path`` as this mount sees it: hidden names are ENOENT."""
        self._reload()
        rel = self._rel(path)
        try:
            st = os.lstat(self._full(path))
        except FileNotFoundError:
            with self._lock:
                self.visible.discard(rel)
                self.own.discard(rel)
                self.appeared.pop(rel, None)
                self._logged_hidden.discard(rel)
                self._forget(rel)
            raise
        if rel and not self._is_visible(rel, st):
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
        return st

    def _is_visible(self, rel: str, st: os.stat_result) -> bool:
        with self._lock:
            if rel in self.own or rel in self.visible:
                return True
            delay = self._delay_s(rel)
            if delay is None:
                return True
            appeared = self.appeared.get(rel)
        if appeared is None:
            appeared = min(_appeared(self._full("/" + rel), st), time.time())
        with self._lock:
            appeared = self.appeared.setdefault(rel, appeared)
            if time.time() >= appeared + delay:
                self.visible.add(rel)
                self.appeared.pop(rel, None)
                return True
        self._fired("hidden", rel, f"(appeared {time.time() - appeared:.3f} s ago, delay {delay:g} s)")
        return False

    def _created(self, rel: str) -> None:
        with self._lock:
            self.own.add(rel)
            self._forget(rel)

    def _exists_now(self, rel: str) -> None:
        """The server said ``rel`` exists (EEXIST): this mount sees it from now on."""
        with self._lock:
            self.visible.add(rel)

    @staticmethod
    def _attrs(st: os.stat_result, size: int | None = None) -> dict:
        return {
            "st_mode": st.st_mode, "st_ino": st.st_ino, "st_nlink": max(1, st.st_nlink), "st_uid": st.st_uid,
            "st_gid": st.st_gid, "st_size": st.st_size if size is None else size, "st_blocks": st.st_blocks,
            "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns,
        }

    # -- metadata -------------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict:
        if fh is not None and fh in self.handles:
            h = self.handles[fh]
            st = os.fstat(fh)
            return self._attrs(st, None if h.cut is None else min(h.cut, st.st_size))
        st = self._lstat(path)
        rel = self._rel(path)
        with self._lock:
            c = self.cache.get(rel)
            if c is not None and c.ino != st.st_ino and stat_mod.S_ISREG(st.st_mode):
                if time.monotonic() - c.filled < (self._stale_s(rel) or 0):
                    return self._attrs(os.fstat(c.fd))
                self._forget(rel)
        return self._attrs(st)

    def access(self, path: str, amode: int) -> int:
        self._lstat(path)
        if not os.access(self._full(path), amode):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return 0

    def readlink(self, path: str) -> str:
        self._lstat(path)
        return os.readlink(self._full(path))

    def statfs(self, path: str) -> dict:
        self._reload()
        sv = os.statvfs(self._full(path))
        out = {k: getattr(sv, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                                           "f_favail", "f_flag", "f_namemax")}
        with self._lock:
            budgets = [max(0, r.enospc_after_bytes - r.written) for r in self.rules if r.enospc_after_bytes is not None]
        if budgets:
            blocks = min(budgets) // max(1, sv.f_frsize)
            out["f_bfree"] = min(out["f_bfree"], blocks)
            out["f_bavail"] = min(out["f_bavail"], blocks)
        return out

    def chmod(self, path: str, mode: int) -> int:
        self._lstat(path)
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._lstat(path)
        os.chown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times=None) -> int:
        self._lstat(path)
        if times is None:
            os.utime(self._full(path))
        else:
            os.utime(self._full(path), ns=(int(times[0]), int(times[1])))
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._lstat(path)
        os.truncate(self._full(path), length)
        with self._lock:
            self._forget(self._rel(path))
        return 0

    # -- namespace ------------------------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        self._reload()
        rel = self._rel(path)
        try:
            os.mkdir(self._full(path), mode)
        except FileExistsError:
            self._exists_now(rel)
            raise
        self._created(rel)
        return 0

    def rmdir(self, path: str) -> int:
        self._lstat(path)
        os.rmdir(self._full(path))
        with self._lock:
            self.own.discard(self._rel(path))
            self.visible.discard(self._rel(path))
        return 0

    def unlink(self, path: str) -> int:
        self._lstat(path)
        os.unlink(self._full(path))
        rel = self._rel(path)
        with self._lock:
            self.own.discard(rel)
            self.visible.discard(rel)
            self._forget(rel)
        return 0

    def rename(self, old: str, new: str) -> int:
        self._lstat(old)
        _carry_appeared(self._full(old), self._full(new))
        os.rename(self._full(old), self._full(new))
        ro, rn = self._rel(old), self._rel(new)
        with self._lock:
            self.own.discard(ro)
            self.visible.discard(ro)
            self._forget(ro)
            self._created(rn)
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._reload()
        os.symlink(source, self._full(target))
        self._created(self._rel(target))
        return 0

    def link(self, target: str, source: str) -> int:
        self._lstat(source)
        os.link(self._full(source), self._full(target))
        self._created(self._rel(target))
        return 0

    # -- directories ----------------------------------------------------------------------

    def opendir(self, path: str) -> int:
        self._lstat(path)
        self._maybe_estale(self._rel(path))
        return 0

    def readdir(self, path: str, fh: int) -> list:
        # (name, attrs, 0): with use_ino the entry's inode comes from attrs, and glibc's
        # readdir skips entries whose inode is 0.
        self._reload()
        full = self._full(path)
        prefix = self._rel(path)
        here = os.lstat(full)
        entries = [(".", {"st_mode": here.st_mode, "st_ino": here.st_ino}, 0),
                   ("..", {"st_mode": stat_mod.S_IFDIR, "st_ino": 1}, 0)]
        for name in os.listdir(full):
            rel = f"{prefix}/{name}" if prefix else name
            try:
                st = os.lstat(os.path.join(full, name))
            except FileNotFoundError:
                continue
            if self._is_visible(rel, st):
                entries.append((name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
        return entries

    def releasedir(self, path: str, fh: int) -> int:
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        fd = os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0

    # -- files ----------------------------------------------------------------------------

    def _maybe_estale(self, rel: str) -> None:
        with self._lock:
            for r in self._matching(rel, "estale"):
                e = r.estale
                count = e.get("count")
                if e.get("per_path"):
                    used = r.estale_per_path.get(rel, 0)
                else:
                    used = r.estale_fired
                if count is not None and used >= int(count):
                    continue
                if "probability" in e and r.rng.random() >= float(e["probability"]):
                    continue
                r.estale_fired += 1
                r.estale_per_path[rel] = r.estale_per_path.get(rel, 0) + 1
                break
            else:
                return
        self._fired("estale", rel)
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))

    def _cut_for(self, rel: str, st: os.stat_result) -> int | None:
        if st.st_size == 0:
            return None
        with self._lock:
            for r in self._matching(rel, "truncate"):
                t = r.truncate
                if t.get("count") is not None and r.truncated_fired >= int(t["count"]):
                    continue
                key = rel if t["per"] == "path" else (rel, st.st_ino, st.st_size, st.st_mtime_ns)
                seen = r.truncate_seen.get(key, 0)
                if seen >= int(t["reads"]):
                    continue
                r.truncate_seen[key] = seen + 1
                r.truncated_fired += 1
                cut = int(st.st_size * float(t["fraction"]))
                break
            else:
                return None
        self._fired("truncated", rel, f"(read cut to {cut} of {st.st_size} bytes)")
        return cut

    def open(self, path: str, flags: int) -> int:
        st = self._lstat(path)
        rel = self._rel(path)
        self._maybe_estale(rel)
        reading = (flags & os.O_ACCMODE) == os.O_RDONLY
        full = self._full(path)
        stale = False
        if not reading:
            with self._lock:
                self._forget(rel)
            fd = os.open(full, flags & ~(os.O_CREAT | os.O_EXCL))
        else:
            fd = os.open(full, flags & ~(os.O_CREAT | os.O_EXCL))
            limit = self._stale_s(rel)
            if limit is not None and stat_mod.S_ISREG(st.st_mode):
                fst = os.fstat(fd)
                with self._lock:
                    c = self.cache.get(rel)
                    now = time.monotonic()
                    if c is not None and now - c.filled < limit:
                        if c.ino != fst.st_ino:
                            os.close(fd)
                            fd = os.dup(c.fd)
                            stale = True
                    else:
                        self._forget(rel)
                        self.cache[rel] = Cached(os.dup(fd), fst.st_ino, now)
            if stale:
                self._fired("stale", rel)
        h = Handle(rel)
        if reading:
            h.cut = self._cut_for(rel, os.fstat(fd))
        self.handles[fd] = h
        return fd

    def create(self, path: str, mode: int, flags: int) -> int:
        self._reload()
        rel = self._rel(path)
        try:
            fd = os.open(self._full(path), flags | os.O_CREAT, mode)
        except FileExistsError:
            self._exists_now(rel)
            raise
        self._created(rel)
        self.handles[fd] = Handle(rel)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        h = self.handles.get(fh)
        if h is not None and h.cut is not None:
            size = max(0, min(size, h.cut - offset))
            if size == 0:
                return b""
        data = os.pread(fh, size, offset)
        rel = h.rel if h is not None else self._rel(path)
        with self._lock:
            self.read_bytes[rel] = self.read_bytes.get(rel, 0) + len(data)
        self._dirty.set()
        return data

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._reload()
        h = self.handles.get(fh)
        rel = self._rel(path) if path is not None else h.rel if h is not None else ""
        allowed = len(data)
        with self._lock:
            rules = self._matching(rel, "enospc_after_bytes")
            for r in rules:
                allowed = min(allowed, max(0, r.enospc_after_bytes - r.written))
        if allowed == 0 and data:
            self._fired("enospc", rel, f"(budget of {[r.enospc_after_bytes for r in rules]} bytes used up)")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.pwrite(fh, data[:allowed], offset)
        with self._lock:
            for r in rules:
                r.written += n
            if rules:
                self._dirty.set()
        return n

    def flush(self, path: str, fh: int) -> int:
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        return 0

    def release(self, path: str, fh: int) -> int:
        self.handles.pop(fh, None)
        os.close(fh)
        return 0

    # -- lifecycle ------------------------------------------------------------------------

    def init_with_config(self, conn, config) -> None:
        if config is not None:
            config.entry_timeout = 0.0
            config.negative_timeout = 0.0
            config.attr_timeout = 0.0
            config.direct_io = 1
            config.hard_remove = 1
            config.use_ino = 1
            config.kernel_cache = 0
            config.auto_cache = 0

    def destroy(self, path: str) -> None:
        self._stop.set()
        self._write_stats()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.faultfs", description=__doc__.split("\n\n")[0])
    p.add_argument("backing", type=Path)
    p.add_argument("mountpoint", type=Path)
    p.add_argument("--control", type=Path, required=True, help="JSON fault rules, re-read when it changes")
    p.add_argument("--stats", type=Path, default=None, help="where to write fault counts (default CONTROL.stats.json)")
    p.add_argument("--debug", action="store_true", help="libfuse debug output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if not args.backing.is_dir():
        p.error(f"backing directory {args.backing} does not exist")
    import mfusepy

    ops = FaultFS(args.backing, args.control, args.stats or args.control.with_name(args.control.name + ".stats.json"))
    log.info("faultfs: %s on %s (control %s)", args.backing, args.mountpoint, args.control)
    mfusepy.FUSE(ops, str(args.mountpoint), foreground=True, debug=args.debug, fsname="faultfs", subtype="faultfs",
                 direct_io=True, hard_remove=True, use_ino=True,
                 entry_timeout=0, negative_timeout=0, attr_timeout=0)
    ops._stop.set()
    ops._write_stats()
    log.info("faultfs: %s unmounted", args.mountpoint)
    return 0


# -- the test-side API -----------------------------------------------------------------------

def missing_prerequisites() -> list[str]:
    """What this machine lacks to run faultfs mounts; empty when everything is there."""
    missing = []
    try:
        import mfusepy  # noqa: F401 - raises when no libfuse is found
    except ImportError:
        missing.append("the Python package mfusepy (pip install mfusepy)")
    except (OSError, AttributeError) as e:
        missing.append(f"libfuse for mfusepy ({e}; apt package fuse3)")
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        missing.append("fusermount3 (apt package fuse3)")
    if not FUSE_DEVICE.exists():
        missing.append(f"{FUSE_DEVICE} (FUSE device; a container needs --device /dev/fuse)")
    elif not os.access(FUSE_DEVICE, os.R_OK | os.W_OK):
        missing.append(f"read/write access to {FUSE_DEVICE}")
    return missing


def _fusermount() -> str:
    return shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"


def rules_doc(faults: dict | list | None) -> dict:
    """Accepts ``{"rules": [...]}``, a list of rules, one rule, or None (no faults)."""
    if faults is None:
        return {"rules": []}
    if isinstance(faults, list):
        return {"rules": faults}
    if "rules" in faults:
        return faults
    return {"rules": [faults]}


REPO_ROOT = Path(__file__).resolve().parents[1]


class FaultMount:
    """One faultfs mount of ``backing`` at ``mountpoint``, in its own process.

    ``with FaultMount(backing, mnt, faults={...}) as m: ...; m.set_faults({...})``.
    :meth:`close` always unmounts (``fusermount3 -u``, retried while busy, then lazily) and
    stops the process, and raises if the mount point is still mounted afterwards.
    """

    def __init__(self, backing: Path, mountpoint: Path, faults: dict | list | None = None, *, workdir: Path | None = None):
        self.backing = Path(backing)
        self.path = Path(mountpoint)
        workdir = Path(workdir) if workdir is not None else self.path.parent
        self.control = workdir / f"{self.path.name}.faults.json"
        self.stats_path = workdir / f"{self.path.name}.stats.json"
        self.log = workdir / f"{self.path.name}.faultfs.log"
        self.proc: subprocess.Popen | None = None
        self.backing.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(parents=True, exist_ok=True)
        self.set_faults(faults)

    def __enter__(self) -> "FaultMount":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultMount({self.backing} at {self.path})"

    def start(self) -> "FaultMount":
        if is_mounted(self.path):
            raise RuntimeError(f"{self.path} is already a mount point")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.faultfs", str(self.backing), str(self.path), "--control", str(self.control),
                 "--stats", str(self.stats_path)],
                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + MOUNT_DEADLINE_S
        while time.monotonic() < deadline:
            if is_mounted(self.path):
                try:
                    os.stat(self.path)
                    return self
                except OSError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"faultfs for {self.path} exited with {self.proc.returncode} before mounting: {self.output()}")
            time.sleep(0.02)
        self.close()
        raise RuntimeError(f"faultfs mount {self.path} not live after {MOUNT_DEADLINE_S} s: {self.output()}")

    def set_faults(self, faults: dict | list | None) -> None:
        """Replace this mount's faults; the next call through the mount sees them."""
        doc = rules_doc(faults)
        parse_rules(doc)  # fail here, in the test, on a malformed rule
        tmp = self.control.with_name(f".{self.control.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps(doc, sort_keys=True))
        os.replace(tmp, self.control)

    def clear_faults(self) -> None:
        self.set_faults(None)

    def stats(self) -> dict:
        """Fault counts as last written by the mount (at most ~50 ms old)."""
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {"counts": {k: 0 for k in KINDS}, "first_at": {}, "last_at": {}}

    def wait_stats(self, predicate, timeout: float = 5.0, what: str = "the mount's stats") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if predicate(s):
                return s
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}; last stats: {s}")
            time.sleep(0.02)

    def count(self, kind: str) -> int:
        return self.stats().get("counts", {}).get(kind, 0)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace").strip()[-4000:] or "(no output)"
        except OSError:
            return "(no log)"

    def close(self, busy_retry_s: float = UNMOUNT_DEADLINE_S) -> None:
        """Unmount (retrying ``fusermount -u`` for ``busy_retry_s`` while busy: a just-killed
        process may still hold a file), else lazily; stop the process; raise if still mounted."""
        errors = []
        deadline = time.monotonic() + busy_retry_s
        while is_mounted(self.path) and time.monotonic() < deadline:
            r = subprocess.run([_fusermount(), "-u", str(self.path)], capture_output=True, text=True)
            if r.returncode == 0:
                break
            errors.append(r.stderr.strip())
            time.sleep(0.1)
        for cmd in ([_fusermount(), "-uz", str(self.path)], ["umount", "-l", str(self.path)]):
            if not is_mounted(self.path):
                break
            r = subprocess.run(cmd, capture_output=True, text=True)
            errors.append(r.stderr.strip())
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None
        if is_mounted(self.path):
            raise RuntimeError(f"faultfs teardown: {self.path} is still mounted ({'; '.join(e for e in errors if e)})")


def _stop(proc: subprocess.Popen) -> None:
    """A faultfs in the foreground exits once unmounted; after a lazy unmount it may not."""
    try:
        proc.wait(timeout=1)
        return
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    code = main()
    # Unmounted, stats written: leave now. A normal interpreter exit waits ~2 s for libfuse's
    # idle worker threads, which would only slow every test's teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
