"""Counting filesystem operations with strace.

A process tree runs under

    strace -f -ff -ttt -y -qq --seccomp-bpf -e trace=<SYSCALLS> -o <prefix>

which writes one file per thread (``<prefix>.<tid>``; a process's main thread has
tid == pid), every traced call with its wall time, and every file descriptor with the path
it refers to (``-y``). :func:`parse` keeps the calls that name a path under the run's
directories (in an argument, or through a descriptor) and nothing else: a Python start-up's
imports, the bench's own files and anything outside the shared directory are left out.

What is counted, per call, is one system call as the kernel sees it, not one RPC to a
server: on NFS an ``openat`` is a LOOKUP (unless cached) plus an OPEN/ACCESS and a GETATTR
(close-to-open), an ``fstat`` of an open file is usually served from the attribute cache,
and ``getdents64`` is one READDIR(PLUS) RPC per buffer of entries (each entry's attributes
come with it). Kinds:

    by name   openat/open/creat, stat/lstat/newfstatat/statx with a path, access,
              mkdir, rename, unlink, rmdir, utimensat, readlink: each one path lookup
    by fd     fstat (newfstatat with AT_EMPTY_PATH), getdents64 (a listing; the bench
              also counts the names a listing returns)
    fsync     fsync, fdatasync: data made durable, reported apart from metadata

"metadata ops" = by name + by fd. Reads and writes of file contents, close and lseek are
not traced.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

SYSCALLS = [
    "open", "openat", "creat", "stat", "lstat", "fstat", "newfstatat", "statx", "access", "faccessat", "faccessat2",
    "mkdir", "mkdirat", "rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "utimensat",
    "readlink", "readlinkat", "getdents64", "fsync", "fdatasync",
    "clone", "clone3", "fork", "vfork",  # not counted: they tell which threads belong to which process
]
FSYNC = {"fsync", "fdatasync"}
BY_FD = {"fstat", "getdents64"}

_LINE = re.compile(r"^(?P<t>\d+\.\d+) (?P<call>\w+)\((?P<args>.*)\) += (?P<ret>.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD = re.compile(r"\d+<([^>]*)>")


def available() -> bool:
    return shutil.which("strace") is not None


def prefix(out_prefix: Path) -> list[str]:
    """The command prefix that traces a process tree into ``<out_prefix>.<tid>`` files."""
    return ["strace", "-f", "-ff", "-ttt", "-y", "-qq", "--seccomp-bpf", "-e", "trace=" + ",".join(SYSCALLS),
            "-o", str(out_prefix)]


@dataclass(frozen=True, slots=True)
class Call:
    t: float  # wall time, comparable with time.time() of the traced processes
    name: str  # syscall
    path: str  # the first path under the roots it touches
    kind: str  # "name", "fd" or "fsync"
    ret: str  # the return value as strace printed it
    flags: str  # the raw arguments (for O_CREAT, O_DIRECTORY, ...)


def _kind(name: str, args: str) -> str:
    if name in FSYNC:
        return "fsync"
    if name in BY_FD or (name == "newfstatat" and "AT_EMPTY_PATH" in args):
        return "fd"
    return "name"


def parse(trace: Path, roots: list[str]) -> list[Call]:
    """The calls in one thread's trace file that touch a path under one of ``roots``."""
    roots = [r.rstrip("/") for r in roots]
    out = []
    with open(trace, errors="replace") as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if m is None:
                continue
            args = m["args"]
            paths = [*_QUOTED.findall(args), *_FD.findall(args)]
            hit = next((p for p in paths if any(p == r or p.startswith(r + "/") for r in roots)), None)
            if hit is None:
                continue
            out.append(Call(float(m["t"]), m["call"], hit, _kind(m["call"], args), m["ret"], args))
    return out


def threads(out_prefix: Path) -> dict[int, Path]:
    """tid -> its trace file."""
    return {int(p.name.rsplit(".", 1)[1]): p for p in out_prefix.parent.glob(out_prefix.name + ".*")
            if p.name.rsplit(".", 1)[1].isdigit()}


def tally(calls: list[Call]) -> dict:
    """Counts by kind and by syscall; "metadata" = by name + by fd."""
    by_call: dict[str, int] = {}
    kinds = {"name": 0, "fd": 0, "fsync": 0}
    for c in calls:
        by_call[c.name] = by_call.get(c.name, 0) + 1
        kinds[c.kind] += 1
    return {"metadata": kinds["name"] + kinds["fd"], "by_name": kinds["name"], "by_fd": kinds["fd"],
            "fsync": kinds["fsync"], "by_call": dict(sorted(by_call.items()))}


def add(a: dict, b: dict) -> dict:
    by_call = dict(a.get("by_call", {}))
    for k, v in b.get("by_call", {}).items():
        by_call[k] = by_call.get(k, 0) + v
    return {k: a.get(k, 0) + b.get(k, 0) for k in ("metadata", "by_name", "by_fd", "fsync")} | {"by_call": dict(sorted(by_call.items()))}


def scale(a: dict, factor: float) -> dict:
    return {k: a[k] * factor for k in ("metadata", "by_name", "by_fd", "fsync")} | {
        "by_call": {k: v * factor for k, v in a["by_call"].items()}}


_CLONE = re.compile(r"^\d+\.\d+ (?:clone3?|fork|vfork)\(.*\) += (\d+)")


def spawned(trace: Path) -> list[int]:
    """The threads and processes this thread started (traced clone/fork returns)."""
    out = []
    with open(trace, errors="replace") as f:
        for line in f:
            m = _CLONE.match(line)
            if m:
                out.append(int(m[1]))
    return out


def owners(files: dict[int, Path], roots: dict[int, int]) -> dict[int, int]:
    """tid -> the owner (e.g. rank) of the process tree it belongs to; ``roots`` maps each
    tree's first pid to its owner."""
    owner = dict(roots)
    todo = list(roots)
    while todo:
        tid = todo.pop()
        if tid not in files:
            continue
        for child in spawned(files[tid]):
            if child not in owner:
                owner[child] = owner[tid]
                todo.append(child)
    return owner
