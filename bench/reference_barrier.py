"""The reference design's barrier, reproduced faithfully, as a baseline for ours.

The reference (the multi-node design this project replaces: flags under ``/logs/multinode_flags/``, "barriers
poll with `ls` every 2-5 s") has each rank touch its flag file, then list the flag directory
and count the phase's flags until all N are there, sleeping between looks:

    touch <dir>/<phase>_<rank>.flag
    while [ "$(ls <dir> | grep -c '^<phase>_')" -lt N ]; do sleep 5; done

Here one Python process per rank does exactly that: ``os.close(os.open(flag, O_CREAT))``,
then ``os.listdir(dir)``, count the names that start with ``<phase>_`` and end with
``.flag``, sleep, repeat. ``<phase>`` is ``it<I>-ph<P>`` (iteration and phase, so that each
round has its own flags); like the reference, nothing deletes flags during a run, so the
directory grows by N names per round and every listing returns all of them. The sleep is
either fixed (``fixed:5``, the reference) or our backoff (``backoff:0.002:0.1``: 2 ms doubling
to ``coordination.poll_max_s``), restarting at each round.

Rounds run back to back (no work between them), or, with ``--skew-s S``, after a random
sleep of 0..S s per rank (uneven work, so that ranks wait for each other as in a real run).
Each rank writes, per round: the wall time just after its flag was created (arrive), the
wall time its count reached N (released), and how many listings it made and how many
names they returned in total (the per-entry work a metadata server does for a listing).

    python bench/reference_barrier.py --dir D --num-nodes 4 --rounds 14 --interval fixed:5
    (one process per rank; bench/barrier_compare.py runs it side by side with ours)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ITERATION_PHASES = 14  # the reference walks 14 phases per iteration, each ending in this barrier


def parse_interval(spec: str):
    """``fixed:S`` or ``backoff:MIN:MAX`` -> a factory of sleep-interval iterators."""
    kind, _, rest = spec.partition(":")
    if kind == "fixed":
        seconds = float(rest)

        def fixed():
            while True:
                yield seconds
        return fixed
    if kind == "backoff":
        lo, hi = (float(x) for x in rest.split(":"))

        def backoff():
            interval = lo
            while True:
                yield interval
                interval = min(interval * 2, hi)
        return backoff
    raise ValueError(f"interval {spec!r}: expected fixed:S or backoff:MIN:MAX")


def phase_name(round_index: int) -> str:
    iteration, phase = divmod(round_index, ITERATION_PHASES)
    return f"it{iteration + 1:04d}-ph{phase:02d}"


def rank_main(flag_dir: Path, rank: int, num_nodes: int, rounds: int, interval: str, out: Path,
              start_at: float | None, skew_s: float = 0.0) -> None:
    intervals = parse_interval(interval)
    rng = random.Random(rank)
    if start_at is not None:  # all ranks begin together, as after a previous barrier
        time.sleep(max(0.0, start_at - time.time()))
    records = []
    for k in range(rounds):
        phase = phase_name(k)
        if skew_s > 0:  # stands in for phase work of uneven length before the barrier
            time.sleep(rng.uniform(0, skew_s))
        os.close(os.open(flag_dir / f"{phase}_{rank}.flag", os.O_WRONLY | os.O_CREAT, 0o644))
        arrive = time.time()
        listings = names = 0
        sleeps = intervals()
        while True:
            listing = os.listdir(flag_dir)
            listings += 1
            names += len(listing)
            if sum(1 for n in listing if n.startswith(phase + "_") and n.endswith(".flag")) >= num_nodes:
                break
            time.sleep(next(sleeps))
        records.append({"round": k, "phase": phase, "arrive": arrive, "released": time.time(),
                        "listings": listings, "names": names})
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), "rounds": records}))
    os.replace(tmp, out)


def launch(flag_dirs: list[Path], rounds: int, interval: str, out_dir: Path, *, wrap=None, env=None,
           timeout_s: float = 3600.0, skew_s: float = 0.0) -> list[dict]:
    """Run one rank per entry of ``flag_dirs`` (rank r lists ``flag_dirs[r]``, its own mount on
    sshfs) to completion; returns each rank's records. ``wrap(rank)`` gives a command prefix
    (strace) or None."""
    num_nodes = len(flag_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    start_at = time.time() + 0.5 + 0.03 * num_nodes  # after every interpreter has started
    procs = []
    try:
        for rank, d in enumerate(flag_dirs):
            argv = [sys.executable, __file__, "--dir", str(d), "--rank", str(rank), "--num-nodes", str(num_nodes),
                    "--rounds", str(rounds), "--interval", interval, "--out", str(out_dir / f"r{rank}.json"),
                    "--start-at", repr(start_at), "--skew-s", repr(skew_s)]
            prefix = wrap(rank) if wrap else None
            log = open(out_dir / f"r{rank}.log", "wb")
            procs.append(subprocess.Popen([*(prefix or []), *argv], stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))
            log.close()
        deadline = time.monotonic() + timeout_s
        codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [r for r, c in enumerate(codes) if c != 0]
    if bad:
        tail = (out_dir / f"r{bad[0]}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"reference barrier ranks {bad} failed (exit {codes[bad[0]]}): {tail}")
    return [json.loads((out_dir / f"r{r}.json").read_text()) for r in range(num_nodes)]


def rounds_summary(ranks: list[dict]) -> list[dict]:
    """Per round: last arrive -> last released (the same measure as ours), listings, names."""
    out = []
    for k in range(len(ranks[0]["rounds"])):
        rs = [r["rounds"][k] for r in ranks]
        out.append({
            "round": k, "phase": rs[0]["phase"],
            "last_arrive_to_last_released_s": max(x["released"] for x in rs) - max(x["arrive"] for x in rs),
            "arrive_spread_s": max(x["arrive"] for x in rs) - min(x["arrive"] for x in rs),
            "listings": sum(x["listings"] for x in rs),
            "names_listed": sum(x["names"] for x in rs),
        })
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="the flag directory (this rank's view of it)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--num-nodes", type=int, required=True)
    p.add_argument("--rounds", type=int, default=ITERATION_PHASES)
    p.add_argument("--interval", default="fixed:5", help="fixed:S (the reference: 5) or backoff:MIN:MAX (ours)")
    p.add_argument("--out", type=Path, required=True, help="this rank's records (JSON)")
    p.add_argument("--start-at", type=float, default=None, help="wall time to start the first round at")
    p.add_argument("--skew-s", type=float, default=0.0,
                   help="sleep a random 0..S s before each arrival (uneven work; default 0: back to back)")
    a = p.parse_args(argv)
    rank_main(a.dir, a.rank, a.num_nodes, a.rounds, a.interval, a.out, a.start_at, a.skew_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
