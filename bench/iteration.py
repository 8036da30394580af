"""Per-iteration wall time of the README main job: warm processes against restarts.

    python bench/iteration.py                               # makes demo data in a temp dir first
    python bench/iteration.py --data-path /tmp/orch-data   # reuse demo data (orchestrator demo-data)

Runs the README's main job (one node, the embedded engine on CPU, ``--eval-interval 3``,
``--max-iterations 10`` by default) twice, one after the other, on fresh log paths:

warm      the defaults: ``train.keep_alive=true`` (one trainer process for the run, its model
          and optimizer kept in memory) and ``rollout.weight_update=auto`` (the engine serves
          on through training and reloads each new checkpoint in place)
restart   ``train.keep_alive=false rollout.weight_update=restart``: a trainer process per
          iteration that loads the checkpoint, and the engine stopped in phase 7 and started
          again on the new checkpoint in phase 12 (the restart mode)

For each, the seconds of every iteration (the master's phases, from ``status --json``'s
``iterations[].timing``), their mean over iterations 2..N (iteration 1 starts the processes
in both modes) and over all, and the breakdown: the phases that take time and the parts
inside training and the engine phases. ``--repeats`` alternates the two modes. Writes JSON
(default bench/results/iteration.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, console, demo_data, machine, python_env, run_iterations, table, wait_for_quiet, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "iteration.json"
MODES = {
    "warm": [],
    "restart": ["train.keep_alive=false", "rollout.weight_update=restart"],
}
# Phases shown on their own in the breakdown; the rest are summed as "other".
SHOWN = ("1:rollout", "6:eval", "7:engine_stop", "10:train", "12:engine_restart")


def run_mode(mode: str, data: Path, work: Path, iterations: int, timeout_s: float) -> dict:
    log_path = work / f"run-{mode}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "orchestrator", "run", f"--data-path={data}", f"--log-path={log_path}", "--rl-phase=both",
            "--eval-interval=3", f"--max-iterations={iterations}", *MODES[mode]]
    wall, done = run_iterations(argv, log_path, iterations=iterations, env=python_env(), timeout_s=timeout_s, what=mode)
    per_iteration = [it["timing"] for it in done]
    totals = [t["total_s"] for t in per_iteration]
    steady = per_iteration[1:] or per_iteration
    phases = {label: statistics.mean(t["phases"].get(label, 0.0) for t in steady) for label in SHOWN}
    phases["other"] = statistics.mean(t["total_s"] for t in steady) - sum(phases.values())
    parts = sorted({p for t in steady for p in t["parts"]})
    return {
        "mode": mode,
        "overrides": MODES[mode],
        "wall_s": round(wall, 3),
        "iteration_s": [round(x, 3) for x in totals],
        "mean_all_s": round(statistics.mean(totals), 3),
        "mean_steady_s": round(statistics.mean(t["total_s"] for t in steady), 3),
        "phases_steady_s": {k: round(v, 3) for k, v in phases.items()},
        "parts_steady_s": {p: round(statistics.mean(t["parts"].get(p, 0.0) for t in steady), 3) for p in parts},
        "accuracy": [it["metrics"]["accuracy"] for it in done if it.get("metrics")],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-path", type=Path, help="demo data made by `orchestrator demo-data` (default: made here)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    parser.add_argument("--max-load", type=float, help="wait until the 1-minute load average is below this")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    load = wait_for_quiet(args.max_load, max_wait_s=600)
    with tempfile.TemporaryDirectory(prefix="bench-iteration-") as tmp:
        work = Path(tmp)
        data = demo_data(args.data_path, work)
        runs = []
        for k in range(args.repeats):
            for mode in (("warm", "restart") if k % 2 == 0 else ("restart", "warm")):
                console.print(f"repeat {k + 1}/{args.repeats}: {mode} ...")
                runs.append(run_mode(mode, data, work, args.iterations, args.timeout_s))
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in MODES}
    summary = {m: {"mean_steady_s": statistics.median(r["mean_steady_s"] for r in rs),
                   "mean_all_s": statistics.median(r["mean_all_s"] for r in rs),
                   "wall_s": statistics.median(r["wall_s"] for r in rs)} for m, rs in by_mode.items()}
    ratio = summary["warm"]["mean_steady_s"] / summary["restart"]["mean_steady_s"]
    table("seconds per iteration (median of repeats)", ["mode", "iterations 2..N", "all", "whole run"],
          [[m, f"{s['mean_steady_s']:.2f}", f"{s['mean_all_s']:.2f}", f"{s['wall_s']:.1f}"] for m, s in summary.items()])
    last = {m: rs[-1] for m, rs in by_mode.items()}
    labels = [*SHOWN, "other"]
    table("where an iteration's time goes (iterations 2..N, last repeat)", ["phase", *MODES],
          [[label, *(f"{last[m]['phases_steady_s'][label]:.2f}" for m in MODES)] for label in labels])
    parts = sorted({p for r in last.values() for p in r["parts_steady_s"]})
    table("inside training and the engine phases (slowest rank, iterations 2..N)", ["part", *MODES],
          [[p, *(f"{last[m]['parts_steady_s'].get(p, 0.0):.3f}" for m in MODES)] for p in parts])
    console.print(f"warm / restart, seconds per iteration (2..N): {ratio:.3f}")
    write_json(args.out, {"machine": machine(), "load_before": load, "iterations": args.iterations, "repeats": args.repeats,
                          "summary": summary, "ratio_warm_to_restart": round(ratio, 4), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
