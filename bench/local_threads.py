"""Several ranks on one machine: per-iteration wall time with the cores split between the
ranks (what `orchestrator local` does) against every process taking every core.

    python bench/local_threads.py                               # makes demo data in a temp dir first; ~4 min on 2 cores
    python bench/local_threads.py --data-path /tmp/orch-data   # reuse demo data (orchestrator demo-data)

Runs the real RL loop on ``--num-nodes`` local ranks (``orchestrator local``, the embedded
engine on CPU, ``--eval-interval 3``, ``--max-iterations`` 4 by default) in two modes, one
after the other, on fresh log paths:

split       ``OMP_NUM_THREADS`` unset: `local` gives each rank cores // ranks threads
            (``cli/local.py``, ``thread_budget``)
every-core  ``OMP_NUM_THREADS`` = this machine's (physical) cores in every rank: torch's own default,
            a thread per core in every engine and trainer process (the behaviour before)

For each, the seconds of every iteration (the master's phases, from ``status --json``), the
mean over iterations 2..N (iteration 1 starts the engines and trainers), and the rollout,
eval and train phases of those iterations. The ratio is every-core's over split's.
``--repeats`` alternates the two modes. Writes JSON (default bench/results/local_threads.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, demo_data, machine, python_env, run_iterations, table, wait_for_quiet, write_json  # noqa: E402
from orchestrator.cli.local import cores as usable_cores  # noqa: E402
from orchestrator.cli.local import thread_budget  # noqa: E402

DEFAULT_OUT = RESULTS / "local_threads.json"
MODES = ("split", "every-core")
SHOWN = ("1:rollout", "6:eval", "10:train")


def run_mode(mode: str, data: Path, work: Path, *, num_nodes: int, iterations: int, cores: int, timeout_s: float) -> dict:
    log_path = work / f"run-{mode}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "orchestrator", "local", f"--num-nodes={num_nodes}", f"--data-path={data}", f"--log-path={log_path}",
            "--rl-phase=both", "--eval-interval=3", f"--max-iterations={iterations}"]
    env = {k: v for k, v in python_env().items() if k != "OMP_NUM_THREADS"}
    if mode == "every-core":
        env["OMP_NUM_THREADS"] = str(cores)
    wall, done = run_iterations(argv, log_path, iterations=iterations, env=env, timeout_s=timeout_s, what=mode)
    per_iteration = [it["timing"] for it in done]
    steady = per_iteration[1:] or per_iteration
    return {
        "mode": mode,
        "omp_num_threads": env.get("OMP_NUM_THREADS") or thread_budget(num_nodes, env).get("OMP_NUM_THREADS"),
        "wall_s": round(wall, 3),
        "iteration_s": [round(t["total_s"], 3) for t in per_iteration],
        "mean_steady_s": round(statistics.mean(t["total_s"] for t in steady), 3),
        "phases_steady_s": {label: round(statistics.mean(t["phases"].get(label, 0.0) for t in steady), 3) for label in SHOWN},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", type=Path, help="demo data made by `orchestrator demo-data` (default: made here)")
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    parser.add_argument("--max-load", type=float, help="wait until the 1-minute load average is below this")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.num_nodes < 2:
        parser.error("--num-nodes must be at least 2: one rank has the machine to itself")
    cores = usable_cores()
    load = wait_for_quiet(args.max_load, max_wait_s=600)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-local-threads-") as tmp:
        work = Path(tmp)
        data = demo_data(args.data_path, work)
        try:
            for k in range(args.repeats):
                for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                    console.print(f"repeat {k + 1}/{args.repeats}: {mode} ...")
                    runs.append(run_mode(mode, data, work, num_nodes=args.num_nodes, iterations=args.iterations, cores=cores,
                                         timeout_s=args.timeout_s))
        except BenchError as e:
            console.print(f"local_threads: error: {e}", markup=False, style="red")
            return 1
    summary = {}
    for m in MODES:
        mine = [r for r in runs if r["mode"] == m]
        summary[m] = {key: statistics.median(r[key] for r in mine) for key in ("mean_steady_s", "wall_s")}
        summary[m]["phases_steady_s"] = {p: statistics.median(r["phases_steady_s"][p] for r in mine) for p in SHOWN}
    ratio = round(summary["every-core"]["mean_steady_s"] / summary["split"]["mean_steady_s"], 3)
    table(f"{args.num_nodes} local ranks, {cores} cores: seconds per iteration (iterations 2..{args.iterations}, median over repeats)",
          ["mode", "OMP_NUM_THREADS", "iteration", *SHOWN, "run wall"],
          [[m, next(r["omp_num_threads"] for r in runs if r["mode"] == m), f"{summary[m]['mean_steady_s']:.2f}",
            *(f"{summary[m]['phases_steady_s'][p]:.2f}" for p in SHOWN), f"{summary[m]['wall_s']:.1f}"] for m in MODES])
    console.print(f"every-core / split, seconds per iteration: {ratio:.2f}x", markup=False)
    write_json(args.out, {"bench": "local_threads", "machine": machine(), "load_before": load, "num_nodes": args.num_nodes, "cores": cores,
                          "iterations": args.iterations, "summary": summary, "every_core_over_split": ratio, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
