"""Orchestration overhead per iteration vs the number of ranks: an iteration's wall time minus
its simulated work.

    python bench/overhead.py                                  # N = 1, 4, 16, 64; work_s 0.5; 4 iterations
    python bench/overhead.py --num-nodes 4 --num-nodes 16 --work-s 1 --iterations 3

For each N, a rehearsal through ``orchestrator local`` (bench/barrier_latency.py: 64 train
and 32 eval tasks per iteration, eval every 2nd iteration, default poll settings) with
``rehearsal.work_s`` = --work-s: the rehearsal sleeps that long in each of rollout, eval (on
iterations where it is due) and train, on every rank at once. An iteration spans from the
last rank's release of the previous iteration's last barrier (iteration 1: the first rank
entering phase 0) to the last rank's release of its own last barrier; overhead = that wall
time - work_s x (2, or 3 with eval). It covers the 12 barrier rounds, the shards' writes,
seals, merge and checks, the train config, the checkpoint marker and pointer, and the
stand-in engine's stop and restart. Start-up (interpreters, imports, lease, join) is given
apart.

Prints a table and writes JSON (default bench/results/overhead.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import barrier_latency  # noqa: E402
from bench.common import RESULTS, err_console, console, loadavg, machine, stats, table, wait_for_quiet, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "overhead.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-nodes", type=int, action="append", help="ranks (repeat; default 1, 4, 16, 64)")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--work-s", type=float, default=0.5, help="rehearsal.work_s (default 0.5)")
    p.add_argument("--timeout-s", type=float, default=1200.0)
    p.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this first")
    p.add_argument("--max-wait-s", type=float, default=1200.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    load = wait_for_quiet(a.max_load, a.max_wait_s)
    result = {"machine": machine(), "loadavg_at_start": load, "work_s": a.work_s, "iterations": a.iterations, "runs": []}
    for n in a.num_nodes or [1, 4, 16, 64]:
        console.print(f"{n} ranks x {a.iterations} iterations, work_s={a.work_s:g} ...", markup=False)
        try:
            run = barrier_latency.run_bench(n, a.iterations, work_s=a.work_s, timeout_s=a.timeout_s)
        except barrier_latency.BenchError as e:
            err_console.print(f"overhead: error at {n} ranks: {e}", markup=False)
            return 1
        its = run["iterations"]
        result["runs"].append({
            "num_nodes": n, "loadavg_after": loadavg(),
            "overhead_per_iteration_s": stats([i["overhead_s"] for i in its]),
            "wall_per_iteration_s": stats([i["wall_s"] for i in its]),
            "barrier_latency_s": run["summary"]["last_arrive_to_last_released_s"],
            "startup_s": run["summary"].get("startup_s"), "total_wall_s": run["summary"].get("total_wall_s"),
            "iterations": its,
        })
        write_json(a.out, result)
    rows = [[r["num_nodes"], f"{r['wall_per_iteration_s']['p50']:.2f}",
             f"{r['overhead_per_iteration_s']['p50']:.2f}", f"{r['overhead_per_iteration_s']['max']:.2f}",
             f"{r['barrier_latency_s']['p50'] * 1e3:.1f}", f"{r['startup_s']:.1f}"] for r in result["runs"]]
    table(f"orchestration overhead per iteration (s), work_s={a.work_s:g}, {a.iterations} iterations",
          ["ranks", "wall p50", "overhead p50", "overhead max", "barrier p50 (ms)", "start-up (s)"], rows)
    result["machine"]["loadavg_at_end"] = loadavg()
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
