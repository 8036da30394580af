"""The physical floor of a file hand-off on a filesystem: one publish + one read by name.

    python bench/fs_floor.py                          # local directory and sshfs, 300 repetitions each
    python bench/fs_floor.py --fs local --reps 1000 --out /tmp/floor.json

One process, one round trip per repetition, back to back:

    writer (client A)  open(tmp, O_CREAT|O_EXCL) + write 96 bytes + fsync + close + rename(tmp, final)
    reader (client B)  open(final) + read + close, repeated at once until it returns this
                       repetition's sequence number (an older one: read again)

``final`` is the same name every time, overwritten like ``release.json`` and the arrival
files of the barrier. On a local directory A and B are the same directory; on sshfs they are
two mounts of one export (two clients with their own caches, as two nodes would be), so a
repetition ends when the write through A is visible through B. The time of a repetition is
the floor for one hop of a barrier; a barrier round needs at least two hops in sequence (the
last arrival to the master, then the release to the workers), plus the master's
``progress.json`` write between them.

A second row does the same through the project's own functions (``fsio.write_record``:
mkdir -p of the parent, unique temp name, checksum envelope, fsync, ``os.replace``; then
``fsio.read_record`` until valid): the price of that layer over the bare calls.

Prints p50/p99 per filesystem and writes JSON (default bench/results/fs_floor.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    FILESYSTEMS,
    RESULTS,
    BenchError,
    err_console,
    machine,
    ms,
    rank_dirs,
    stats,
    table,
    wait_for_quiet,
    write_json,
)
from orchestrator.protocol import fsio  # noqa: E402

DEFAULT_OUT = RESULTS / "fs_floor.json"
PAYLOAD = 96


def bare_round_trip(a: Path, b: Path, seq: int) -> tuple[float, int]:
    """Seconds for one publish through ``a`` to be read through ``b``, and the reads it took."""
    body = json.dumps({"seq": seq}).encode().ljust(PAYLOAD - 1) + b"\n"
    tmp, name = a / f".release.json.{seq}.tmp", "release.json"
    began = time.perf_counter()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, body)
    os.fsync(fd)
    os.close(fd)
    os.rename(tmp, a / name)
    reads = 0
    while True:
        reads += 1
        try:
            fd = os.open(b / name, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        if data == body:
            return time.perf_counter() - began, reads
        if reads > 1_000_000:
            raise BenchError(f"{b / name} never showed repetition {seq}")


def fsio_round_trip(a: Path, b: Path, seq: int) -> tuple[float, int]:
    began = time.perf_counter()
    fsio.write_record(a / "record.json", {"seq": seq})
    reads = 0
    while True:
        reads += 1
        got = fsio.read_record(b / "record.json")
        if got is not None and got.get("seq") == seq:
            return time.perf_counter() - began, reads
        if reads > 1_000_000:
            raise BenchError(f"{b / 'record.json'} never showed repetition {seq}")


def measure(a: Path, b: Path, reps: int, warmup: int = 20) -> dict:
    """Both round trips, ``reps`` times each after ``warmup`` unmeasured ones."""
    out = {}
    for name, fn in (("bare", bare_round_trip), ("fsio", fsio_round_trip)):
        times, reads = [], []
        for seq in range(warmup + reps):
            t, n = fn(a, b, seq)
            if seq >= warmup:
                times.append(t)
                reads.append(n)
        out[name] = {**stats(times), "reads_mean": sum(reads) / len(reads), "reads_max": max(reads)}
    return out


def floor_on(fs: str, reps: int, work: Path) -> dict:
    with rank_dirs(fs, work, 2) as (_export, (a, b)):
        d_a, d_b = a / "floor", b / "floor"
        d_a.mkdir(exist_ok=True)
        return measure(d_a, d_b, reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fs", action="append", choices=FILESYSTEMS, help="local and/or sshfs (default both)")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--work-dir", type=Path, default=None, help="where the local directory and mounts go (default: a temp dir)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this first")
    p.add_argument("--max-wait-s", type=float, default=1200.0)
    a = p.parse_args(argv)
    wait_for_quiet(a.max_load, a.max_wait_s)
    result = {"machine": machine(), "reps": a.reps, "floor": {}}
    try:
        for fs in a.fs or list(FILESYSTEMS):
            with tempfile.TemporaryDirectory(prefix=f"fs-floor-{fs}-", dir=a.work_dir) as work:
                result["floor"][fs] = floor_on(fs, a.reps, Path(work))
    except BenchError as e:
        err_console.print(f"fs_floor: error: {e}", markup=False)
        return 1
    rows = [[fs, kind, ms(r["p50"], 3), ms(r["p99"], 3), ms(r["max"], 3), f"{r['reads_mean']:.2f}"]
            for fs, by in result["floor"].items() for kind, r in by.items()]
    table(f"create+write+fsync+rename, then open+read by name until seen ({a.reps} repetitions; ms)",
          ["filesystem", "round trip", "p50", "p99", "max", "reads per trip"], rows, right_from=2)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
