"""How fast one host can release N waiting Python processes at all: the floor under a barrier
of N ranks on one host, apart from the protocol.

    python bench/wake_floor.py                              # 15 waiters; busy 0, 1, 2, 4 ms; 40 rounds each
    python bench/wake_floor.py --waiters 15 --busy-ms 0 --busy-ms 3.5 --rounds 60 --out /tmp/wake.json

One writer and ``--waiters`` processes (the workers of a barrier of N = waiters + 1 ranks).
Each waiter blocks on its own inotify descriptor (watchdog's ``inotify_init``, a watch on one
directory, ``select``: no threads in between), and on each event opens the release file by
name until it carries this round's number. A round: the writer renames a new release file
into place, and the round lasts until the last waiter has read it (each sends its wall time
back on a queue; all on one host, so wall clocks compare). Rounds start ``--gap-ms`` apart.

``--busy-ms B``: after it has read a release, each waiter spends B ms of CPU before it waits
again, as a released rank does its next phase's work before it arrives at the next barrier.
A rank of ``bench/barrier_latency.py`` (``rehearsal.work_s=0``) spends about 3.5 ms from its
release to its next arrival when it has a core to itself. With fewer cores than waiters, the
waiters released first take the cores, and the scheduler does not hand one to a just-woken
waiter at once: that, not the file hand-off, sets the round's length at B > 0.

Prints p50 / p99 / max of the round per B, and as a multiple of the p50 of one waiter
(B = 0), the single hand-off; JSON to --out (default bench/results/wake_floor.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import select
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, console, machine, ms, stats, table, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "wake_floor.json"
RELEASE = "release.json"
READY_TIMEOUT_S = 60.0
ROUND_TIMEOUT_S = 30.0


def _waiter(directory: str, rounds: int, busy_s: float, ready, seen) -> None:
    from watchdog.observers.inotify_c import InotifyConstants, inotify_add_watch, inotify_init

    fd = inotify_init()
    if fd < 0 or inotify_add_watch(fd, directory.encode(), InotifyConstants.IN_MOVED_TO) < 0:
        ready.put(f"inotify refused (errno {__import__('ctypes').get_errno()})")
        return
    ready.put("ok")
    path = os.path.join(directory, RELEASE)
    for number in range(rounds):
        while not _carries(path, number):
            if not select.select([fd], [], [], ROUND_TIMEOUT_S)[0]:
                return  # the writer is gone: it reports the timeout
            os.read(fd, 65536)
        seen.put(time.time())
        start = time.process_time()
        while time.process_time() - start < busy_s:
            pass


def _carries(path: str, number: int) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["round"] == number
    except (FileNotFoundError, ValueError):
        return False


def measure(waiters: int, busy_ms: float, rounds: int, gap_ms: float) -> list[float]:
    """Seconds from each round's rename to its last waiter's read."""
    ctx = mp.get_context("fork")
    ready, seen = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="wake-floor-") as directory:
        procs = [ctx.Process(target=_waiter, args=(directory, rounds, busy_ms / 1e3, ready, seen), daemon=True)
                 for _ in range(waiters)]
        for p in procs:
            p.start()
        try:
            for _ in procs:
                answer = ready.get(timeout=READY_TIMEOUT_S)
                if answer != "ok":
                    raise SystemExit(f"wake_floor: error: {answer}")
            took = []
            for number in range(rounds):
                time.sleep(gap_ms / 1e3)
                temp = os.path.join(directory, f".{RELEASE}.tmp")
                start = time.time()
                with open(temp, "w", encoding="utf-8") as f:
                    json.dump({"round": number}, f)
                os.rename(temp, os.path.join(directory, RELEASE))
                took.append(max(seen.get(timeout=ROUND_TIMEOUT_S) for _ in procs) - start)
            return took
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiters", type=int, default=15, help="processes released each round (default 15: the workers of 16 ranks)")
    parser.add_argument("--busy-ms", type=float, action="append", help="CPU each waiter spends after a release (repeatable; default 0 1 2 4)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=50.0, help="pause between rounds, longer than the busy time")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.waiters < 1 or args.rounds < 1:
        parser.error("--waiters and --rounds must be at least 1")
    busy = args.busy_ms or [0.0, 1.0, 2.0, 4.0]
    single = stats(measure(1, 0.0, args.rounds, args.gap_ms))
    rows, results = [["1 waiter, 0 ms", ms(single["p50"], 2), ms(single["p99"], 2), ms(single["max"], 2), "1.0"]], []
    for b in busy:
        s = stats(measure(args.waiters, b, args.rounds, args.gap_ms))
        results.append({"waiters": args.waiters, "busy_ms": b, **s, "p50_over_single": s["p50"] / single["p50"]})
        rows.append([f"{args.waiters} waiters, {b:g} ms", ms(s["p50"], 2), ms(s["p99"], 2), ms(s["max"], 2),
                     f"{s['p50'] / single['p50']:.1f}"])
    table(f"release of N waiting processes on {os.cpu_count()} CPUs: rename -> last waiter's read (ms)",
          ["waiters, busy after release", "p50", "p99", "max", "p50 / single"], rows)
    write_json(args.out, {"machine": machine(), "config": vars(args) | {"out": str(args.out), "busy_ms": busy},
                          "single": single, "results": results})
    console.print("each waiter: its own inotify descriptor and select, no threads; see the module docstring", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
