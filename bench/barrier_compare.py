"""Barrier latency and metadata operations per round: ours against the reference design,
on a local directory and on sshfs, next to the filesystem's own floor.

    python bench/barrier_compare.py                                  # local and sshfs, N = 4, 16, 64
    python bench/barrier_compare.py --fs local --num-nodes 4 --num-nodes 16 --out bench/results/barrier_local.json
    python bench/barrier_compare.py --fs sshfs --reference-rounds 5  # the reference waits ~20 s a round there

For each filesystem (``--fs``): the floor (bench/fs_floor.py: one create + fsync + rename
seen by one open by name), then for each N (``--num-nodes``), on one set of directories
(local: one directory; sshfs: one sshfs client per rank, all of one export):

ours            N real ranks, ``orchestrator run --rehearsal`` (bench/barrier_latency.py: local
                through ``orchestrator local``, sshfs one ``run`` per rank on its own mount),
                ``rehearsal.work_s=0``, default polling (2 ms doubling to
                ``coordination.poll_max_s`` = 100 ms), ``--iterations`` iterations of 12
                barrier rounds; latency from the ranks' event logs.
reference-5s    the reference's barrier (bench/reference_barrier.py: touch a flag, ``ls`` the
                flag directory, count, sleep 5 s), ``--reference-rounds`` rounds.
reference-ours  the same with our interval (2 ms doubling to 100 ms), rounds back to back.
reference-ours-skew  (local) the same, but each rank first sleeps a random 0..S s, S chosen so
                that arrivals spread as much as ours' did (p50 of last - first arrival):
                ours' ranks do phase work between barriers, so the first to arrive have
                backed off to longer polls when the last one comes.

Latency of a round = last rank's release seen - last rank's arrival (wall clocks of ranks on
this host), p50/p99/max over the rounds, and p50 as a multiple of the floor's p50.

Metadata operations per round (``--count-ops``, needs strace): the same designs run again
under strace (bench/opcount.py says exactly what is counted), ``--ops-iterations`` of ours,
``--ops-rounds`` of the reference. Ours counts, per rank, the calls its main thread makes
on the run directory from the start of writing its arrival to seeing the release, summed
over ranks ("protocol": files under ``attempts/<A>/`` and ``control/``; the master's
decisions (plan, summary, seal checks) apart as "decision"); the heartbeat and monitor
threads, which run whatever the barriers do, are given as a rate. The reference counts
every call its ranks make on the flag directory, and the names its listings return.
strace slows every traced call, so these runs are not used for latency, except the
reference runs whose rounds last seconds anyway (5 s interval, and every reference run on
sshfs): there one traced run gives both.

``--max-load L`` waits (up to ``--max-wait-s``) for the 1-minute load average to drop
below L before measuring; the load seen is recorded either way. JSON goes to --out
(default bench/results/barrier_compare.json).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import barrier_latency as ours_bench  # noqa: E402
from bench import fs_floor, opcount, reference_barrier  # noqa: E402
from bench.common import (  # noqa: E402
    FILESYSTEMS,
    RESULTS,
    BenchError,
    console,
    err_console,
    loadavg,
    machine,
    ms,
    rank_dirs,
    stats,
    table,
    wait_for_quiet,
    write_json,
)
from orchestrator.protocol import fsio  # noqa: E402
from orchestrator.protocol.layout import RunLayout  # noqa: E402

DEFAULT_OUT = RESULTS / "barrier_compare.json"
OUR_INTERVAL = "backoff:0.002:0.1"  # coordination.poll_min_s, poll_max_s defaults
SSHFS_STALE_NOTE = "sshfs caches listings 20 s by default"


# -- ours -----------------------------------------------------------------------------------------

def run_ours(fs: str, export: Path, dirs: list[Path], work: Path, name: str, iterations: int, timeout_s: float,
             prefix: list[str] | None = None):
    """One rehearsal run of ``len(dirs)`` ranks; returns (the run's directory seen from the export, launch)."""
    n = len(dirs)
    rank_work = work / name
    rank_work.mkdir()
    if fs == "local":
        info = ours_bench.launch(n, iterations, export / name, rank_work, timeout_s=timeout_s, prefix=prefix)
    else:
        info = ours_bench.launch_ranks([d / name for d in dirs], iterations, rank_work, timeout_s=timeout_s, prefix=prefix)
    if info.returncode != 0:
        raise BenchError(f"ours ({fs}, {n} ranks) failed: exit {info.returncode}; output in {info.output}\n{info.tail()}")
    return export / name, info


def ours_latency(fs, export, dirs, work, iterations, timeout_s) -> dict:
    run, info = run_ours(fs, export, dirs, work, "ours", iterations, timeout_s)
    result = ours_bench.analyze(run, len(dirs), iterations, 0.0, info)
    latencies = [r["last_arrive_to_last_released_s"] for r in result["rounds"]]
    return {"latency": stats(latencies), "rounds": len(latencies), "wall_s": info.wall_s,
            "arrive_spread": stats([r["arrive_spread_s"] for r in result["rounds"]]),
            "overhead_per_iteration_s": result["summary"]["overhead_per_iteration_s"],
            "startup_s": result["summary"].get("startup_s"), "per_round": result["rounds"]}


def _classify(path: str) -> str:
    return "protocol" if "/attempts/" in path or "/control/" in path or path.endswith("/control") else "decision"


def ours_ops(fs, export, dirs, work, iterations, timeout_s) -> dict:
    traces = work / "trace-ours"
    traces.mkdir()
    run, info = run_ours(fs, export, dirs, work, "ours-traced", iterations, timeout_s,
                         prefix=opcount.prefix(traces / "t"))
    n = len(dirs)
    roots = sorted({str(export / "ours-traced"), *(str(d / "ours-traced") for d in dirs)})
    layout = RunLayout(run)
    (attempt_id,) = [p.name for p in layout.attempts.iterdir() if p.is_dir()]
    attempt = layout.attempt(attempt_id)
    pids = {r: fsio.read_record(attempt.join(r))["pid"] for r in range(n)}
    files = opcount.threads(traces / "t")
    owner = opcount.owners(files, {pid: r for r, pid in pids.items()})
    events = ours_bench.rank_events(run, n)
    main_calls = {r: opcount.parse(files[pids[r]], roots) for r in range(n)}

    rounds = ours_bench.barrier_rounds(iterations)
    per_round = []
    for it, ph in rounds:
        protocol, decision, polls = [], [], {"master": 0, "workers": 0}
        for r in range(n):
            ev = {e["event"]: e["t"] for e in events[r]
                  if e.get("iteration") == it and e.get("phase") == ph and e["event"] in ("arrive", "released")}
            calls = main_calls[r]
            starts = [i for i, c in enumerate(calls)
                      if c.t <= ev["arrive"] and c.name in ("mkdir", "mkdirat") and c.path.endswith("/arrivals")]
            if not starts:
                raise BenchError(f"rank {r}: no arrival write found before its arrive event at iteration {it} phase {ph}")
            window = [c for c in calls[starts[-1]:] if c.t <= ev["released"]]
            for c in window:
                (protocol if _classify(c.path) == "protocol" else decision).append(c)
                if c.name == "openat" and "O_DIRECTORY" in c.flags:
                    if r == 0 and c.path.endswith("/arrivals"):
                        polls["master"] += 1
                    elif r != 0 and c.path.endswith("/" + attempt_id):
                        polls["workers"] += 1
        per_round.append({"iteration": it, "phase": ph, "protocol": opcount.tally(protocol),
                          "decision": opcount.tally(decision), "polls": polls})

    # The heartbeat and monitor threads: every traced call on the run directory by a thread
    # other than a rank's main one, as a rate over the walk.
    background = {r: {} for r in range(n)}
    for tid, path in files.items():
        r = owner.get(tid)
        if r is None or tid == pids[r]:
            continue
        background[r] = opcount.add(background[r], opcount.tally(opcount.parse(path, roots)))
    walk_s = max(e["t"] for ev in events.values() for e in ev) - min(e["t"] for ev in events.values() for e in ev)
    k = len(per_round)
    mean_protocol = opcount.scale(_sum(p["protocol"] for p in per_round), 1 / k)
    return {
        "rounds": k,
        "traced_wall_s": info.wall_s,
        "per_round": mean_protocol,
        "per_round_per_rank": mean_protocol["metadata"] / n,
        "decision_per_round": opcount.scale(_sum(p["decision"] for p in per_round), 1 / k),
        "polls_per_round": {"master": sum(p["polls"]["master"] for p in per_round) / k,
                            "workers_total": sum(p["polls"]["workers"] for p in per_round) / k},
        "names_listed_per_round": 0,
        "background_per_s": {"master": background[0].get("metadata", 0) / walk_s,
                             "worker_mean": sum(background[r].get("metadata", 0) for r in range(1, n)) / max(1, n - 1) / walk_s},
        "rounds_detail": per_round,
    }


def _sum(tallies) -> dict:
    total: dict = {}
    for t in tallies:
        total = opcount.add(total, t)
    return total


# -- the reference --------------------------------------------------------------------------------

def run_reference(dirs: list[Path], export: Path, work: Path, name: str, rounds: int, interval: str,
                  traced: bool, timeout_s: float, skew_s: float = 0.0) -> dict:
    (export / name).mkdir()
    traces = work / f"trace-{name}"
    wrap = None
    if traced:
        traces.mkdir()
        wrap = lambda rank: opcount.prefix(traces / f"r{rank}")  # noqa: E731
    began = time.monotonic()
    ranks = reference_barrier.launch([d / name for d in dirs], rounds, interval, work / name, wrap=wrap,
                                     timeout_s=timeout_s, skew_s=skew_s)
    per_round = reference_barrier.rounds_summary(ranks)
    n = len(dirs)
    out = {"rounds": rounds, "interval": interval, "skew_s": skew_s, "wall_s": time.monotonic() - began, "traced": traced,
           "latency": stats([r["last_arrive_to_last_released_s"] for r in per_round]),
           "arrive_spread": stats([r["arrive_spread_s"] for r in per_round]),
           "listings_per_round": sum(r["listings"] for r in per_round) / rounds,
           "names_listed_per_round": sum(r["names_listed"] for r in per_round) / rounds,
           "per_round_detail": per_round}
    if traced:
        roots = sorted({str(export / name), *(str(d / name) for d in dirs)})
        total: dict = {}
        for r in range(n):
            for _tid, path in opcount.threads(traces / f"r{r}").items():
                total = opcount.add(total, opcount.tally(opcount.parse(path, roots)))
        out["ops"] = {"rounds": rounds, "per_round": opcount.scale(total, 1 / rounds),
                      "per_round_per_rank": total["metadata"] / rounds / n,
                      "names_listed_per_round": out["names_listed_per_round"],
                      "listings_per_round": out["listings_per_round"]}
    return out


# -- one filesystem, one N ----------------------------------------------------------------------

def measure(fs: str, n: int, a: argparse.Namespace, work: Path) -> list[dict]:
    results = []
    fixed = f"fixed:{a.reference_interval_s:g}"
    ref_rounds = a.reference_rounds if a.reference_rounds is not None else (5 if fs == "sshfs" else 14)
    with rank_dirs(fs, work, n) as (export, dirs):
        console.print(f"[{fs}, {n} ranks] ours: {a.iterations} iterations ...", markup=False)
        row = {"fs": fs, "num_nodes": n, "design": "ours", "loadavg_before": loadavg(), **ours_latency(fs, export, dirs, work, a.iterations, a.timeout_s)}
        if a.count_ops:
            console.print(f"[{fs}, {n} ranks] ours under strace: {a.ops_iterations} iteration(s) ...", markup=False)
            row["ops"] = ours_ops(fs, export, dirs, work, a.ops_iterations, a.timeout_s)
        results.append(row)

        if not a.skip_reference_fixed:
            console.print(f"[{fs}, {n} ranks] reference, {fixed}: {ref_rounds} rounds ...", markup=False)
            row = {"fs": fs, "num_nodes": n, "design": f"reference-{a.reference_interval_s:g}s", "loadavg_before": loadavg(),
                   **run_reference(dirs, export, work, "ref-fixed", ref_rounds, fixed, a.count_ops, a.timeout_s)}
            row["ops"] = row.pop("ops", None)
            results.append(row)

        slow = fs == "sshfs"  # listings stay stale for ~20 s: rounds last seconds, strace costs nothing there
        console.print(f"[{fs}, {n} ranks] reference, our interval: {ref_rounds if slow else a.reference_fast_rounds} rounds ...", markup=False)
        row = {"fs": fs, "num_nodes": n, "design": "reference-ours", "loadavg_before": loadavg(),
               **run_reference(dirs, export, work, "ref-ours", ref_rounds if slow else a.reference_fast_rounds, OUR_INTERVAL,
                               a.count_ops and slow, a.timeout_s)}
        if a.count_ops and not slow:
            console.print(f"[{fs}, {n} ranks] reference, our interval, under strace: {a.ops_rounds} rounds ...", markup=False)
            row["ops"] = run_reference(dirs, export, work, "ref-ours-traced", a.ops_rounds, OUR_INTERVAL, True, a.timeout_s)["ops"]
        row["ops"] = row.get("ops")
        results.append(row)

        if not slow and a.reference_skew and n > 1:
            # Ours' ranks do phase work between barriers and arrive spread out, so the early ones
            # have backed off to longer polls by the time the last arrives; give the reference
            # the same spread (uniform 0..S per rank has an expected range of S (N-1)/(N+1)).
            spread = results[0]["arrive_spread"]["p50"]
            skew = spread * (n + 1) / (n - 1)
            console.print(f"[{fs}, {n} ranks] reference, our interval, arrivals spread like ours' "
                          f"({spread * 1e3:.1f} ms): {a.reference_fast_rounds} rounds ...", markup=False)
            row = {"fs": fs, "num_nodes": n, "design": "reference-ours-skew", "loadavg_before": loadavg(),
                   **run_reference(dirs, export, work, "ref-ours-skew", a.reference_fast_rounds, OUR_INTERVAL, False,
                                   a.timeout_s, skew_s=skew), "ops": None}
            results.append(row)
    return results


# -- output ---------------------------------------------------------------------------------------

def _times(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:,.0f}x"


def render(result: dict) -> None:
    floor = result["floor"]
    rows = [[fs, kind, ms(r["p50"], 3), ms(r["p99"], 3)] for fs, by in floor.items() for kind, r in by.items()]
    table("floor: create+write+fsync+rename, then open+read by name (ms)", ["filesystem", "round trip", "p50", "p99"], rows, 2)
    rows = []
    for r in result["runs"]:
        lat, f = r["latency"], floor.get(r["fs"], {}).get("bare", {}).get("p50")
        per_iteration = 12 if r["design"] == "ours" else reference_barrier.ITERATION_PHASES
        rows.append([r["fs"], r["num_nodes"], r["design"], r["rounds"], ms(r["arrive_spread"]["p50"]), ms(lat["p50"]),
                     ms(lat["p99"]), ms(lat["max"]), ms(lat["mean"]), f"{lat['mean'] * per_iteration:.2f}",
                     _times(lat["p50"] / f) if f else "-"])
    table("barrier latency: last arrival -> last release seen (ms); idle per iteration = mean x rounds per iteration "
          "(ours 12, the reference 14)",
          ["filesystem", "ranks", "design", "rounds", "arrival spread p50", "p50", "p99", "max", "mean",
           "idle per iteration (s)", "p50 / floor"], rows, 3)
    rows = []
    for r in result["runs"]:
        o = r.get("ops")
        if not o:
            continue
        pr = o["per_round"]
        rows.append([r["fs"], r["num_nodes"], r["design"], o["rounds"], f"{pr['metadata']:.0f}",
                     f"{o['per_round_per_rank']:.1f}", f"{pr['by_name']:.0f}", f"{pr['by_fd']:.0f}", f"{pr['fsync']:.0f}",
                     f"{o['names_listed_per_round']:.0f}"])
    if rows:
        table("metadata operations per barrier round (strace; see bench/opcount.py)",
              ["filesystem", "ranks", "design", "rounds", "metadata ops", "per rank", "by name", "by fd", "fsync",
               "names listed"], rows, 3)
    for r in result["runs"]:
        o = r.get("ops")
        if r["design"] == "ours" and o:
            console.print(f"{r['fs']}, {r['num_nodes']} ranks, ours: polls per round master {o['polls_per_round']['master']:.1f}, "
                          f"workers {o['polls_per_round']['workers_total']:.1f}; decision ops per round "
                          f"{o['decision_per_round'].get('metadata', 0):.1f}; heartbeat+monitor threads "
                          f"{o['background_per_s']['master']:.0f} ops/s (master), {o['background_per_s']['worker_mean']:.0f} ops/s "
                          f"(each worker)", markup=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fs", action="append", choices=FILESYSTEMS, help="local and/or sshfs (default both)")
    p.add_argument("--num-nodes", type=int, action="append", help="ranks (repeat; default 4, 16, 64)")
    p.add_argument("--iterations", type=int, default=5, help="iterations of ours for latency (12 rounds each; default 5)")
    p.add_argument("--reference-interval-s", type=float, default=5.0, help="the reference's sleep (default 5)")
    p.add_argument("--reference-rounds", type=int, default=None,
                   help="rounds of the reference with its own interval (default 14 = one iteration; 5 on sshfs)")
    p.add_argument("--reference-fast-rounds", type=int, default=60, help="rounds of the reference with our interval (default 60)")
    p.add_argument("--skip-reference-fixed", action="store_true", help="leave out the reference at its own interval")
    p.add_argument("--reference-skew", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the reference at our interval with arrivals spread like ours' (local only; default on)")
    p.add_argument("--count-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="count metadata operations with strace (default: when strace is installed)")
    p.add_argument("--ops-iterations", type=int, default=1, help="iterations of ours under strace (default 1)")
    p.add_argument("--ops-rounds", type=int, default=14, help="rounds of the reference under strace (default 14)")
    p.add_argument("--floor-reps", type=int, default=300)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run (default 1800)")
    p.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this first")
    p.add_argument("--max-wait-s", type=float, default=1200.0)
    p.add_argument("--work-dir", type=Path, default=None, help="parent of the temp dir (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, traces)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    if a.count_ops is None:
        a.count_ops = opcount.available()
    elif a.count_ops and not opcount.available():
        p.error("--count-ops needs strace (apt-get install strace)")
    filesystems = a.fs or list(FILESYSTEMS)
    sizes = a.num_nodes or [4, 16, 64]

    load = wait_for_quiet(a.max_load, a.max_wait_s)
    result = {"machine": machine(), "loadavg_at_start": load,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "floor": {}, "runs": []}
    work = Path(tempfile.mkdtemp(prefix="barrier-compare-", dir=a.work_dir))
    ok = False
    try:
        for fs in filesystems:
            console.print(f"[{fs}] floor: {a.floor_reps} round trips ...", markup=False)
            (work / f"floor-{fs}").mkdir()
            result["floor"][fs] = fs_floor.floor_on(fs, a.floor_reps, work / f"floor-{fs}")
            for n in sizes:
                (work / f"{fs}-{n}").mkdir()
                result["runs"] += measure(fs, n, a, work / f"{fs}-{n}")
                write_json(a.out, result)  # what is done so far survives a later failure
        ok = True
    except (BenchError, RuntimeError) as e:
        err_console.print(f"barrier_compare: error: {e}", markup=False)
        return 1
    finally:
        result["machine"]["loadavg_at_end"] = loadavg()
        if ok and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"kept: {work}", markup=False, style="dim")
    render(result)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
