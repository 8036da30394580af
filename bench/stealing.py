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

    python bench/stealing.py --wave-ranks 64,256,1024     # claim files opened per stealing wave

counts instead what one stealing wave costs (:func:`wave`): that many ranks' ledgers in this
process, on a local directory (/dev/shm where there is one), taking turns on a simulated clock (every ``--slow-every``-th
rank ``--factor`` times slower), each rank taking chunks until none is left for it; it counts
the claim files each rank opens (read, created) and the claims directory refreshes, and
checks that every chunk was taken exactly once; then what each rank, restarted, opens to
find the chunks it holds (``Ledger.owned``).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, machine, python_env, run_iterations, table, wait_for_quiet, write_json  # noqa: E402
from orchestrator.data import claims  # noqa: E402
from orchestrator.protocol import fsio  # noqa: E402
from orchestrator.protocol.layout import IterationLayout  # noqa: E402

DEFAULT_OUT = RESULTS / "stealing.json"
WAVE_OUT = RESULTS / "stealing-wave.json"
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


@contextlib.contextmanager
def counting_opens(opens: list[int], rank: list[int]) -> Iterator[None]:
    """Count, into ``opens[rank[0]]``, each claim file read or created, each record written (a
    thief's ``stolen.r<R>.json``) and each claims directory refreshed (what claims.py opens by name)."""
    real = {name: getattr(fsio, name) for name in ("read_bytes", "create_record_exclusive", "write_record", "refresh_dir")}

    def counted(fn):
        def call(*args, **kwargs):
            opens[rank[0]] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in real.items():
        setattr(fsio, name, counted(fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(fsio, name, fn)


def wave(root: Path, ranks: int, *, chunks_per_rank: int = claims.CHUNKS_PER_RANK, slow_every: int = 4,
         factor: float = 4.0) -> dict:
    """One stealing wave of ``ranks`` ranks (one task a chunk, ``chunks_per_rank`` chunks each)
    on ``root``, in this process: each rank, when its clock says it is free, takes its next
    chunk (``Ledger.take``) and is busy for the chunk's tasks times its slowness, until none is
    left for it. Then each rank is restarted (a fresh ledger) and finds the chunks it holds.
    Returns the opens of each rank in the wave and in its restart, the chunks each took, when
    the last finished and the ideal (total work over total speed). Raises AssertionError
    unless every chunk was taken exactly once, by the rank its claim names, and each restarted
    rank found exactly the chunks it took."""
    it = IterationLayout(root)
    chunks = claims.cut([chunks_per_rank] * ranks, 1)
    ledgers = [claims.Ledger(it, "train", r, chunks, stealing=True, settle_s=60.0, attempt="wave") for r in range(ranks)]
    slowness = [factor if r % slow_every == slow_every - 1 else 1.0 for r in range(ranks)]
    opens, current = [0] * ranks, [0]
    taken: dict[int, list[int]] = {r: [] for r in range(ranks)}
    end = 0.0
    free_at = [(0.0, r) for r in range(ranks)]
    with counting_opens(opens, current):
        while free_at:
            t, r = heapq.heappop(free_at)
            current[0] = r
            chunk, pending = ledgers[r].take()
            if chunk is not None:
                taken[r].append(chunk.index)
                heapq.heappush(free_at, (t + chunk.size * slowness[r], r))
            elif pending:
                heapq.heappush(free_at, (t + 1.0, r))
            else:
                end = max(end, t)
    assert sorted(k for ks in taken.values() for k in ks) == list(range(len(chunks))), "a chunk taken twice or never"
    owner = claims.owners(it, "train", chunks)
    assert all(owner[k] == r for r, ks in taken.items() for k in ks), "a chunk taken by a rank its claim does not name"
    restart_opens = [0] * ranks
    with counting_opens(restart_opens, current):
        for r in range(ranks):
            current[0] = r
            held = claims.Ledger(it, "train", r, chunks, stealing=True, settle_s=60.0, attempt="wave").owned()
            assert sorted(c.index for c in held) == sorted(taken[r]), f"restarted rank {r} found other chunks than it took"
    return {"ranks": ranks, "chunks": len(chunks), "opens": opens, "restart_opens": restart_opens, "taken": taken,
            "stolen": sum(chunks[k].rank != r for r, ks in taken.items() for k in ks),
            "end": end, "ideal": round(len(chunks) / sum(1.0 / s for s in slowness), 3)}


def report_waves(args: argparse.Namespace) -> int:
    rows, results = [], []
    for n in args.wave_ranks:
        # tmpfs where there is one: the claims' fsyncs are not what is counted, and cost minutes on a disk
        with tempfile.TemporaryDirectory(prefix="bench-stealing-wave-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
            start = time.monotonic()
            w = wave(Path(tmp), n, slow_every=args.slow_every, factor=args.factor)
            seconds = time.monotonic() - start
        total, restart = sum(w["opens"]), sum(w["restart_opens"])
        results.append({"ranks": n, "chunks": w["chunks"], "opens": total, "opens_per_rank": round(total / n, 1),
                        "max_opens_of_a_rank": max(w["opens"]), "restart_opens_per_rank": round(restart / n, 1),
                        "max_restart_opens_of_a_rank": max(w["restart_opens"]), "stolen": w["stolen"], "end": w["end"],
                        "ideal": w["ideal"], "seconds": round(seconds, 1)})
        rows.append([str(n), str(w["chunks"]), str(total), f"{total / n:.1f}", str(max(w["opens"])), f"{restart / n:.1f}",
                     str(max(w["restart_opens"])), str(w["stolen"]), f"{w['end']:g} / {w['ideal']:g}"])
    table(f"one stealing wave, {claims.CHUNKS_PER_RANK} chunks per rank, every {args.slow_every}th rank {args.factor:g}x slower",
          ["ranks", "chunks", "opens", "per rank", "most of a rank", "restart, per rank", "most", "stolen", "end / ideal"], rows)
    write_json(args.out, {"benchmark": "stealing-wave", "command": " ".join(sys.argv), "machine": machine(),
                          "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "waves": results})
    return 0


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
    parser.add_argument("--wave-ranks", type=lambda v: [int(n) for n in v.split(",")],
                        help="instead: the claim files one stealing wave opens, at each of these numbers of ranks")
    parser.add_argument("--slow-every", type=int, default=4, help="--wave-ranks: every this-many-th rank is --factor slower")
    parser.add_argument("--out", type=Path, help=f"default {DEFAULT_OUT} ({WAVE_OUT} with --wave-ranks)")
    args = parser.parse_args()
    if args.wave_ranks:
        args.out = args.out or WAVE_OUT
        return report_waves(args)
    args.out = args.out or DEFAULT_OUT
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
