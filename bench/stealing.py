"""Work stealing against the static split: the rollout phase's wall time with one rank slower
than the others, side by side with the ideal.

    python bench/stealing.py                 # ~1 min on 2 cores
    python bench/stealing.py --tasks 480 --repeats 3

Runs ``orchestrator local`` with ``--num-nodes`` rehearsal ranks (3 by default) at equal
``--rank-weights``, rank ``--slow-rank`` taking ``--factor`` times longer per task
(``rehearsal.slow_ranks``), ``rehearsal.task_s`` seconds per task on the others,
``--rl-phase rollout --rollout-split train-only`` for ``--iterations`` iterations, in two modes
one after the other on fresh log paths (``--repeats`` alternates them):

static    ``coordination.work_stealing=false``: each rank does exactly its weighted share
stealing  the default: a rank that has finished takes chunks not yet started from the rank
          with the most left

The rollout phase is phases 1 and 2 of the master (rollout, then the barrier that waits for
every rank's sealed shard): from the start of the rollout until every rank's work is sealed.
Its mean over iterations is set against the ideal, the total work over the total speed:
``tasks * task_s / sum(1 / factor_r)``. Writes JSON (default bench/results/stealing.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, machine, python_env, run_iterations, table, wait_for_quiet, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "stealing.json"
MODES = ("static", "stealing")
ROLLOUT = ("1:rollout", "2:rollout_done")


def run_mode(mode: str, work: Path, args: argparse.Namespace) -> dict:
    log_path = work / f"run-{mode}-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "orchestrator", "local", f"--num-nodes={args.num_nodes}", f"--data-path={work}",
            f"--log-path={log_path}", "--rehearsal", "--rl-phase=rollout", "--rollout-split=train-only",
            f"--rank-weights={','.join(['1'] * args.num_nodes)}", f"--max-iterations={args.iterations}",
            f"rehearsal.tasks={args.tasks}", f"rehearsal.task_s={args.task_s}", f"rehearsal.slow_ranks={args.slow_rank}:{args.factor}",
            "rehearsal.record_bytes=256", f"coordination.work_stealing={'true' if mode == 'stealing' else 'false'}"]
    if args.chunk_tasks:
        argv.append(f"coordination.chunk_tasks={args.chunk_tasks}")
    _wall, done = run_iterations(argv, log_path, iterations=args.iterations, env=python_env(), timeout_s=args.timeout_s, what=mode)
    rollout = [sum(it["timing"]["phases"].get(label, 0.0) for label in ROLLOUT) for it in done]
    return {
        "mode": mode,
        "rollout_s": [round(s, 3) for s in rollout],
        "mean_rollout_s": round(statistics.mean(rollout), 3),
        "tasks_done_per_rank": [it.get("tasks_done_per_rank") for it in done],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-nodes", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=240, help="rollout tasks per iteration")
    parser.add_argument("--task-s", type=float, default=0.02, help="seconds per task on a rank at normal speed")
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--factor", type=float, default=4.0, help="how many times slower the slow rank is per task")
    parser.add_argument("--chunk-tasks", type=int, default=0, help="coordination.chunk_tasks (0: automatic)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--max-load", type=float, help="wait until the 1-minute load average is below this")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if not 0 <= args.slow_rank < args.num_nodes or args.num_nodes < 2:
        parser.error("--slow-rank must be one of the --num-nodes (at least 2) ranks")
    speed = sum(1.0 / (args.factor if r == args.slow_rank else 1.0) for r in range(args.num_nodes))
    ideal = args.tasks * args.task_s / speed
    load = wait_for_quiet(args.max_load, max_wait_s=600)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-stealing-") as tmp:
        try:
            for _ in range(args.repeats):
                for mode in MODES:
                    runs.append(run_mode(mode, Path(tmp), args))
        except BenchError as e:
            console.print(f"[red]{e}[/]")
            return 1
    summary = {}
    for mode in MODES:
        mean = statistics.mean(r["mean_rollout_s"] for r in runs if r["mode"] == mode)
        summary[mode] = {"mean_rollout_s": round(mean, 3), "over_ideal": round(mean / ideal, 3)}
    table(f"rollout phase, {args.num_nodes} ranks, rank {args.slow_rank} {args.factor:g}x slower, {args.tasks} tasks x "
          f"{args.task_s:g} s", ["split", "rollout s", "x ideal"],
          [["ideal (total work / total speed)", f"{ideal:.3f}", "1.00"]]
          + [[mode, f"{summary[mode]['mean_rollout_s']:.3f}", f"{summary[mode]['over_ideal']:.2f}"] for mode in MODES])
    write_json(args.out, {"benchmark": "stealing", "command": " ".join(sys.argv), "machine": machine(), "load_before": load,
                          "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                          "ideal_s": round(ideal, 3), "summary": summary, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
