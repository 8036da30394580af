"""Asynchronous RL (rl.max_staleness=K): seconds per iteration with rollout and training on
nodes apart, K = 0, 1, 2 in one run, against max(R, T) and R + T; and the main job's demo at
K = 0 and K = 1, wall time and eval curve side by side.

    python bench/async.py                              # rehearsal, R = T = 2 s, ~2 min on 2 cores
    python bench/async.py --rollout-s 3 --train-s 1    # R > T
    python bench/async.py --demo --data-path /tmp/orch-data --iterations 10   # the demo (a few minutes)

Rehearsal (the default): ``orchestrator local --rehearsal`` on 2 ranks, node 0 training
(``train.nodes=0``, weight 0) and node 1 rolling out (``rollout.nodes=1``): R seconds of
rollout per iteration (``rehearsal.tasks`` x ``rehearsal.task_s``), T seconds of training
(``rehearsal.train_s``), eval only on iteration 1 (one task). Seconds per iteration is the
median gap between two iterations' ends (the master's release of phase 13), the steady
state after the pipeline fills; the run's wall time is given too. Each K runs on a fresh
log path, one after the other (``--repeats`` alternates them).

Demo (``--demo``): the same two roles running the real loop (embedded engine on node 1,
the trainer on node 0) on the demo data (``--data-path``, else made in a temp dir) for
``--iterations`` iterations, eval every third, at K = 0 and K = 1 (``--seed``). Writes JSON
(default bench/results/async.json, or async_demo.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, demo_data, machine, python_env, run_iterations, table, wait_for_quiet, write_json  # noqa: E402

ROLES = ["train.nodes=0", "rollout.nodes=1", "--rank-weights=0,1", "--num-nodes=2"]


def iteration_ends(log_path: Path) -> list[float]:
    """When the master released phase 13 of each iteration (wall clock, this host)."""
    ends = {}
    for path in sorted(log_path.glob("attempts/*/events/r00000.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "released" and e.get("phase") == 13:
                ends[e["iteration"]] = e["t"]
    return [ends[i] for i in sorted(ends)]


def rehearsal(k: int, work: Path, args: argparse.Namespace) -> dict:
    log_path = work / f"rehearsal-k{k}-{time.monotonic_ns()}"
    tasks = max(1, round(args.rollout_s / args.task_s))
    argv = [sys.executable, "-m", "orchestrator", "local", *ROLES, f"--data-path={work}", f"--log-path={log_path}", "--rehearsal",
            "--rl-phase=both", f"--eval-interval={args.iterations + 1}", f"--max-iterations={args.iterations}",
            f"rehearsal.tasks={tasks}", f"rehearsal.task_s={args.task_s}", f"rehearsal.train_s={args.train_s}",
            "rehearsal.eval_tasks=1", f"rl.max_staleness={k}"]
    wall, _its = run_iterations(argv, log_path, iterations=args.iterations, env=python_env(), timeout_s=args.timeout_s, what=f"K={k}")
    ends = iteration_ends(log_path)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {"k": k, "wall_s": round(wall, 3), "iteration_gaps_s": [round(g, 3) for g in gaps],
            "s_per_iteration": round(statistics.median(gaps[1:] or gaps), 3)}


def demo(k: int, data: Path, work: Path, args: argparse.Namespace) -> dict:
    log_path = work / f"demo-k{k}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "orchestrator", "local", *ROLES, f"--data-path={data}", f"--log-path={log_path}",
            "--rl-phase=both", "--eval-interval=3", f"--max-iterations={args.iterations}", f"seed={args.seed}",
            f"rl.max_staleness={k}"]
    wall, its = run_iterations(argv, log_path, iterations=args.iterations, env=python_env(), timeout_s=args.timeout_s,
                               what=f"demo K={k}")
    curve = {it["iteration"]: it["metrics"]["accuracy"] for it in its if it.get("evaluated")}
    return {"k": k, "wall_s": round(wall, 3), "eval_accuracy": curve, "staleness": [it.get("staleness") for it in its]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollout-s", type=float, default=2.0, help="R: rollout seconds per iteration (rehearsal)")
    parser.add_argument("--train-s", type=float, default=2.0, help="T: training seconds per iteration (rehearsal)")
    parser.add_argument("--task-s", type=float, default=0.05, help="seconds per rollout task (rehearsal)")
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="rl.max_staleness values (rehearsal)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--demo", action="store_true", help="the demo at K = 0 and 1 instead of the rehearsal")
    parser.add_argument("--data-path", type=Path, help="demo data (--demo); default: made in a temp dir")
    parser.add_argument("--seed", type=int, default=0, help="seed=N of the demo run")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    parser.add_argument("--max-load", type=float, help="wait until the 1-minute load average is below this")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load = wait_for_quiet(args.max_load, max_wait_s=600)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        work = Path(tmp)
        try:
            if args.demo:
                data = demo_data(args.data_path, work)
                for _ in range(args.repeats):
                    runs += [demo(k, data, work, args) for k in (0, 1)]
            else:
                for _ in range(args.repeats):
                    runs += [rehearsal(k, work, args) for k in args.ks]
        except BenchError as e:
            console.print(f"[red]{e}[/]")
            return 1
    common = {"command": " ".join(sys.argv), "machine": machine(), "load_before": load,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if args.demo:
        summary = {k: {"wall_s": round(statistics.median(r["wall_s"] for r in runs if r["k"] == k), 3)} for k in (0, 1)}
        evals = sorted(runs[0]["eval_accuracy"])
        table(f"demo on 2 ranks apart (train.nodes=0 rollout.nodes=1), {args.iterations} iterations, seed {args.seed}",
              ["K", "wall s", "x K=0", *[f"eval {i}" for i in evals]],
              [[r["k"], f"{r['wall_s']:.1f}", f"{r['wall_s'] / summary[0]['wall_s']:.2f}",
                *[f"{r['eval_accuracy'][i]:.3f}" for i in evals]] for r in runs])
        write_json(args.out or RESULTS / "async_demo.json", {"benchmark": "async-demo", **common, "summary": summary, "runs": runs})
        return 0
    ideal, serial = max(args.rollout_s, args.train_s), args.rollout_s + args.train_s
    summary = {}
    for k in args.ks:
        per = statistics.median(r["s_per_iteration"] for r in runs if r["k"] == k)
        summary[k] = {"s_per_iteration": round(per, 3), "over_max_r_t": round(per / ideal, 3), "over_r_plus_t": round(per / serial, 3)}
    base = summary[args.ks[0]]["s_per_iteration"]
    table(f"rehearsal on 2 ranks apart, R = {args.rollout_s:g} s, T = {args.train_s:g} s, {args.iterations} iterations",
          ["K", "s / iteration", f"x K={args.ks[0]}", "x max(R,T)", "x (R+T)", "wall s"],
          [[r["k"], f"{r['s_per_iteration']:.3f}", f"{r['s_per_iteration'] / base:.2f}", f"{r['s_per_iteration'] / ideal:.2f}",
            f"{r['s_per_iteration'] / serial:.2f}", f"{r['wall_s']:.1f}"] for r in runs])
    write_json(args.out or RESULTS / "async.json", {"benchmark": "async", **common, "max_r_t_s": ideal, "r_plus_t_s": serial,
                                                    "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
