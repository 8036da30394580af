"""Barrier latency and orchestration overhead of a rehearsal with N ranks on this machine.

    python bench/barrier_latency.py                       # 16 ranks, 5 iterations, fresh temp dir
    python bench/barrier_latency.py --num-nodes 4 --iterations 10 --poll-max-s 0.05
    python bench/barrier_latency.py --log-path /mnt/sshfs/bench-run   # on another filesystem

It runs, with a subprocess timeout (--timeout-s),

    python -m orchestrator local --num-nodes N --rehearsal --rl-phase both --eval-interval 2
        --max-iterations K --data-path D --log-path L
        rehearsal.work_s=0 rehearsal.tasks=64 rehearsal.eval_tasks=32
        coordination.heartbeat_interval_s=1 coordination.node_timeout_s=30
        [coordination.poll_max_s=S]

(every rank weighs the same: `local` defaults to equal weights; ``launch_ranks`` instead
starts one ``orchestrator run`` per rank, each with its own log path, e.g. its own sshfs
mount, as bench/barrier_compare.py does), then reads every rank's
``attempts/<A>/events/r<R>.jsonl`` and reports, for each barrier round
(iteration, phase):

    release latency  = last rank's "released" - last rank's "arrive"
    master->release  = last rank's "released" - master's "all_arrived"
    (and detect      = master's "all_arrived" - last rank's "arrive"; spread = last - first "released")

All ranks run on this host, so the wall times ``t`` of different ranks are comparable.
A rank logs "arrive" just after it has published its arrival file, so the master can see
that file (and log "all_arrived") a little before the rank logs "arrive": detect can be
slightly negative, and both latencies start at the last arrival's log line, not its write.
The summary gives p50 / p99 / max of both latencies over all rounds (percentiles by linear
interpolation), the number of rounds, the wall times, and the orchestration overhead per
iteration = iteration wall time - simulated work. The rehearsal spends ``rehearsal.work_s``
in each of rollout, eval (on iterations where it is due) and train; the bench sets
``rehearsal.work_s=0`` by default (--work-s), so the iteration wall time IS the overhead.

An iteration spans from the end of the previous one (the last rank's "released" of its
last barrier; for iteration 1, the first "phase" event of any rank) to the last rank's
"released" of its own last barrier, so iterations tile the walk. It includes the
stand-in engine's start (phase 1 of iteration 1) and restart (phase 12, except after the
last iteration): a process spawn per rank.

Exit status: 0 when the run and its logs are complete; 1 (with the reason and the tail of
the ranks' output) when the run fails, times out, or a rank's event log misses a barrier.
Results go to --out (or --json-out; default bench/results/barrier_latency.json, git-ignored),
with the machine and its load average (bench/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/barrier_latency.py` from a checkout that is not installed
    sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.common import descendants, loadavg, machine, percentile, wait_for_quiet  # noqa: E402
from orchestrator.phase_table import Barrier, Phase, eval_due  # noqa: E402
from orchestrator.protocol.events import read_events  # noqa: E402
from orchestrator.protocol.layout import RunLayout  # noqa: E402

DEFAULT_JSON_OUT = REPO / "bench" / "results" / "barrier_latency.json"
EVAL_INTERVAL = 2
TASKS = 64
EVAL_TASKS = 32
PROTOCOL = ["coordination.heartbeat_interval_s=1", "coordination.node_timeout_s=30"]
TERM_GRACE_S = 15.0  # after a timeout: SIGTERM (forwarded to every rank by `local`), then SIGKILL

console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)


class BenchError(Exception):
    """The run or its logs are not what a clean run leaves; the message says why."""


# -- running the ranks --------------------------------------------------------------------------

@dataclass
class Launch:
    argv: list[str]
    returncode: int
    wall_s: float  # launch of `orchestrator local` to its exit
    t_launch: float  # wall clock at launch, comparable with the events' "t"
    output: Path  # combined, rank-prefixed output of all ranks

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.output.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def local_argv(num_nodes: int, iterations: int, log_path: Path, data_path: Path,
               poll_max_s: float | None, work_s: float) -> list[str]:
    argv = [
        sys.executable, "-m", "orchestrator", "local",
        f"--num-nodes={num_nodes}", "--rehearsal", "--rl-phase=both", f"--eval-interval={EVAL_INTERVAL}",
        f"--max-iterations={iterations}", f"--data-path={data_path}", f"--log-path={log_path}",
        f"rehearsal.work_s={work_s:g}", f"rehearsal.tasks={TASKS}", f"rehearsal.eval_tasks={EVAL_TASKS}",
        *PROTOCOL,
    ]
    if poll_max_s is not None:
        argv.append(f"coordination.poll_max_s={poll_max_s:g}")
    return argv


def run_argv(num_nodes: int, iterations: int, log_path: Path, data_path: Path,
             poll_max_s: float | None, work_s: float, rank: int) -> list[str]:
    """What ``local_argv`` starts for ``rank``, as its own `orchestrator run` (its own log path)."""
    argv = local_argv(num_nodes, iterations, log_path, data_path, poll_max_s, work_s)
    return [*argv[:3], "run", *argv[4:], f"--rank-weights={','.join(['1'] * num_nodes)}",
            "--master" if rank == 0 else f"--worker={rank}"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTRATOR_FAULT"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def launch(num_nodes: int, iterations: int, log_path: Path, work_dir: Path, *, poll_max_s: float | None = None,
           work_s: float = 0.0, timeout_s: float = 600.0, prefix: list[str] | None = None) -> Launch:
    """Run the ranks to completion; raise BenchError if they are still running after ``timeout_s``.

    ``prefix`` goes before the command (e.g. strace, which then follows every rank)."""
    log_path = Path(log_path).absolute()
    _check_fresh(log_path)
    data_path = work_dir / "data"  # the rehearsal reads nothing from it; it must be an absolute path
    data_path.mkdir(parents=True, exist_ok=True)
    output = work_dir / "ranks.out"
    argv = [*(prefix or []), *local_argv(num_nodes, iterations, log_path, data_path, poll_max_s, work_s)]
    with open(output, "wb") as out:
        t_launch, m0 = time.time(), time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=_env(), start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise BenchError(
                f"the run did not finish within --timeout-s={timeout_s:g} s and was stopped; "
                f"ranks' output in {output}, logs in {log_path}\n{Launch(argv, -1, 0, 0, output).tail()}"
            ) from None
    return Launch(argv, code, time.monotonic() - m0, t_launch, output)


def launch_ranks(log_paths: list[Path], iterations: int, work_dir: Path, *, poll_max_s: float | None = None,
                 work_s: float = 0.0, timeout_s: float = 600.0, prefix: list[str] | None = None) -> Launch:
    """Like :func:`launch`, but rank r is its own `orchestrator run` with ``log_paths[r]`` as
    its log path: the same run seen through a different mount per rank (sshfs), as on nodes.
    The returned code is the first non-zero exit of a rank (0 if all succeeded)."""
    num_nodes = len(log_paths)
    for lp in log_paths:
        _check_fresh(Path(lp).absolute())
    data_path = work_dir / "data"
    data_path.mkdir(parents=True, exist_ok=True)
    output = work_dir / "ranks.out"
    argvs = [[*(prefix or []), *run_argv(num_nodes, iterations, Path(lp).absolute(), data_path, poll_max_s, work_s, r)]
             for r, lp in enumerate(log_paths)]
    procs: list[subprocess.Popen] = []
    t_launch, m0 = time.time(), time.monotonic()
    try:
        with open(output, "ab") as out:
            for argv in argvs:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=_env(),
                                              start_new_session=True))
        deadline = m0 + timeout_s
        while any(proc.poll() is None for proc in procs):  # a rank that fails ends the run at once
            if any(proc.returncode not in (None, 0) for proc in procs):
                break
            if time.monotonic() > deadline:
                raise BenchError(
                    f"the run did not finish within --timeout-s={timeout_s:g} s and was stopped; "
                    f"ranks' output in {output}\n{Launch(argvs[0], -1, 0, 0, output).tail()}"
                )
            time.sleep(0.05)
        wall = time.monotonic() - m0
    finally:
        for proc in procs:
            if proc.poll() is None:
                _stop(proc)
    codes = [proc.returncode for proc in procs]
    code = next((c for c in codes if c != 0), 0)
    return Launch(argvs[0], code, wall, t_launch, output)


def _check_fresh(log_path: Path) -> None:
    if log_path.exists() and (not log_path.is_dir() or any(log_path.iterdir())):
        raise BenchError(f"--log-path {log_path} is not an empty directory: the run would resume from it; give a fresh path")


def _stop(proc: subprocess.Popen) -> None:
    """Stop `local` and every rank and engine under it (each rank and engine is its own session)."""
    tree = descendants(proc.pid)
    try:
        os.kill(proc.pid, signal.SIGTERM)  # `local` forwards it to every rank, which stops its engine
        proc.wait(timeout=TERM_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [proc.pid, *tree]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


# -- reading the event logs ---------------------------------------------------------------------

def barrier_rounds(iterations: int) -> list[tuple[int, int]]:
    """Every (iteration, phase) a `--rl-phase both` run of ``iterations`` ends with a barrier."""
    return [(i, int(p)) for i in range(1, iterations + 1) for p in Phase if p.spec.barrier is Barrier.ALL]


def rank_events(log_path: Path, num_nodes: int) -> dict[int, list[dict]]:
    """Every rank's event log of the run's one attempt (BenchError if there is not exactly one)."""
    layout = RunLayout(Path(log_path))
    attempts_dir = layout.root / "attempts"
    attempts = sorted(p.name for p in attempts_dir.iterdir() if p.is_dir()) if attempts_dir.is_dir() else []
    if len(attempts) != 1:
        raise BenchError(f"expected exactly one attempt under {attempts_dir}, found {attempts or 'none'}")
    attempt = layout.attempt(attempts[0])
    events = {r: read_events(attempt.events(r)) for r in range(num_nodes)}
    empty = [r for r, ev in events.items() if not ev]
    if empty:
        raise BenchError(f"no events from ranks {empty} in {attempt.root / 'ranks'}")
    return events


def _stats(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values),
            "mean": statistics.fmean(values)}


def analyze(log_path: Path, num_nodes: int, iterations: int, work_s: float, launch_info: Launch | None = None) -> dict:
    """Per-round latencies, per-iteration overhead and the summary; BenchError if a barrier is missing."""
    events = rank_events(log_path, num_nodes)
    by: dict[tuple[str, int, int], dict[int, float]] = {}  # (event, iteration, phase) -> rank -> t
    ends: dict[int, str] = {}
    first_phase_t = min(e["t"] for ev in events.values() for e in ev if e["event"] == "phase")
    for rank, ev in events.items():
        for e in ev:
            if e["event"] in ("arrive", "released", "all_arrived"):
                by.setdefault((e["event"], e["iteration"], e["phase"]), {})[rank] = e["t"]
            elif e["event"] == "end":
                ends[rank] = e["state"]

    problems = [f"rank {r} ended {ends.get(r, 'without an end event')!r}, not 'done'"
                for r in range(num_nodes) if ends.get(r) != "done"]
    rounds = []
    expected = barrier_rounds(iterations)
    for it, ph in expected:
        arrive, released = by.get(("arrive", it, ph), {}), by.get(("released", it, ph), {})
        master = by.get(("all_arrived", it, ph), {}).get(0)
        missing = {kind: sorted(set(range(num_nodes)) - set(got))
                   for kind, got in (("arrive", arrive), ("released", released)) if len(got) != num_nodes}
        if master is None:
            missing["all_arrived (master)"] = [0]
        if missing:
            problems.append(f"iteration {it} {Phase(ph).label}: missing " +
                            "; ".join(f"{k} of ranks {v}" for k, v in missing.items()))
            continue
        last_arrive, last_released = max(arrive.values()), max(released.values())
        rounds.append({
            "iteration": it, "phase": ph, "label": Phase(ph).label,
            "last_arrive_to_last_released_s": last_released - last_arrive,
            "all_arrived_to_last_released_s": last_released - master,
            "last_arrive_to_all_arrived_s": master - last_arrive,
            "released_spread_s": last_released - min(released.values()),
            "arrive_spread_s": last_arrive - min(arrive.values()),
            "last_arrive_rank": max(arrive, key=arrive.get),
            "last_released_rank": max(released, key=released.get),
            "_end": last_released,
        })
    extra = sorted({(it, ph) for (_, it, ph) in by} - set(expected))
    if extra:
        problems.append(f"barriers beyond the {iterations} requested iterations: {extra[:5]}")
    if problems:
        raise BenchError("the event logs are incomplete:\n  " + "\n  ".join(problems[:20]))

    iters = []
    start = first_phase_t
    for it in range(1, iterations + 1):
        end = max(r["_end"] for r in rounds if r["iteration"] == it)
        due = eval_due(it, EVAL_INTERVAL)
        work = work_s * (3 if due else 2)  # rollout + train (+ eval); phases on the critical path
        iters.append({"iteration": it, "eval_due": due, "wall_s": end - start, "simulated_work_s": work,
                      "overhead_s": end - start - work,
                      "barrier_rounds": sum(1 for r in rounds if r["iteration"] == it)})
        start = end
    for r in rounds:
        del r["_end"]

    release = [r["last_arrive_to_last_released_s"] for r in rounds]
    master = [r["all_arrived_to_last_released_s"] for r in rounds]
    walk_s = start - first_phase_t
    summary = {
        "rounds": len(rounds),
        "last_arrive_to_last_released_s": _stats(release),
        "all_arrived_to_last_released_s": _stats(master),
        "last_arrive_to_all_arrived_s": _stats([r["last_arrive_to_all_arrived_s"] for r in rounds]),
        "overhead_per_iteration_s": _stats([i["overhead_s"] for i in iters]),
        "walk_s": walk_s,
        "simulated_work_s": sum(i["simulated_work_s"] for i in iters),
        "overhead_s": walk_s - sum(i["simulated_work_s"] for i in iters),
        "barrier_time_s": sum(release),
    }
    if launch_info is not None:
        summary["total_wall_s"] = launch_info.wall_s
        summary["startup_s"] = first_phase_t - launch_info.t_launch
    return {"rounds": rounds, "iterations": iters, "summary": summary}


# -- reporting ----------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def render(result: dict) -> None:
    cfg, s = result["config"], result["summary"]
    t = Table(title="barrier rounds (ms; wall times of ranks on this host)", title_justify="left")
    for col in ("iter", "phase", "last arrive ->\nlast released", "all_arrived ->\nlast released",
                "last arrive ->\nall_arrived", "released\nspread", "last to\narrive"):
        t.add_column(col, justify="left" if col == "phase" else "right", no_wrap=col == "phase")
    for r in result["rounds"]:
        t.add_row(str(r["iteration"]), r["label"], _ms(r["last_arrive_to_last_released_s"]),
                  _ms(r["all_arrived_to_last_released_s"]), _ms(r["last_arrive_to_all_arrived_s"]),
                  _ms(r["released_spread_s"]), f"r{r['last_arrive_rank']}")
    console.print(t)

    t = Table(title="iterations (s)", title_justify="left")
    for col in ("iter", "eval", "wall", "simulated work", "overhead", "rounds"):
        t.add_column(col, justify="right")
    for i in result["iterations"]:
        t.add_row(str(i["iteration"]), "yes" if i["eval_due"] else "no", f"{i['wall_s']:.3f}",
                  f"{i['simulated_work_s']:.3f}", f"{i['overhead_s']:.3f}", str(i["barrier_rounds"]))
    console.print(t)

    t = Table(title=f"summary: {cfg['num_nodes']} ranks, {cfg['iterations']} iterations, {s['rounds']} barrier rounds, "
                    f"poll_max_s={cfg['poll_max_s']:g}, work_s={cfg['work_s']:g}, log path {cfg['log_path']}",
              title_justify="left")
    for col in ("measure", "p50", "p99", "max", "mean"):
        t.add_column(col, justify="left" if col == "measure" else "right")
    for key, name, unit in (("last_arrive_to_last_released_s", "last arrive -> last released", "ms"),
                            ("all_arrived_to_last_released_s", "all_arrived -> last released", "ms"),
                            ("last_arrive_to_all_arrived_s", "last arrive -> all_arrived", "ms"),
                            ("overhead_per_iteration_s", "overhead per iteration", "ms")):
        st = s[key]
        t.add_row(f"{name} ({unit})", *(_ms(st[k]) for k in ("p50", "p99", "max", "mean")))
    console.print(t)
    lines = [f"barrier rounds: {s['rounds']}",
             f"walk (first phase event -> last release): {s['walk_s']:.3f} s; simulated work {s['simulated_work_s']:.3f} s; "
             f"overhead {s['overhead_s']:.3f} s; in barriers (sum of last arrive -> last released) {s['barrier_time_s']:.3f} s"]
    if "total_wall_s" in s:
        lines.append(f"total wall time (launch of `orchestrator local` -> exit): {s['total_wall_s']:.3f} s, "
                     f"of which start-up (launch -> first phase event) {s['startup_s']:.3f} s")
    if cfg["work_s"] == 0:
        lines.append("rehearsal.work_s=0: no simulated work, so each iteration's wall time is its orchestration overhead")
    for line in lines:
        console.print(line, markup=False)


# -- the command --------------------------------------------------------------------------------

def run_bench(num_nodes: int = 16, iterations: int = 5, log_path: Path | None = None, *,
              poll_max_s: float | None = None, work_s: float = 0.0, timeout_s: float = 600.0,
              keep: bool = False) -> dict:
    """Run the ranks, check and analyse their event logs; BenchError if anything failed."""
    if log_path is not None:
        _check_fresh(Path(log_path).absolute())
    work_dir = Path(tempfile.mkdtemp(prefix="barrier-latency-"))
    run_path = Path(log_path).absolute() if log_path is not None else work_dir / "run"
    machine_before = machine()
    ok = False
    try:
        info = launch(num_nodes, iterations, run_path, work_dir, poll_max_s=poll_max_s, work_s=work_s, timeout_s=timeout_s)
        if info.returncode != 0:
            raise BenchError(f"the run failed: `orchestrator local` exited {info.returncode}; "
                             f"ranks' output in {info.output}, logs in {run_path}\n{info.tail()}")
        result = analyze(run_path, num_nodes, iterations, work_s, info)
        if poll_max_s is None:
            from orchestrator.config import CoordinationConfig

            poll_max_s = CoordinationConfig().poll_max_s
        result = {
            "config": {"num_nodes": num_nodes, "iterations": iterations, "eval_interval": EVAL_INTERVAL,
                       "poll_max_s": poll_max_s, "work_s": work_s, "log_path": str(run_path),
                       "command": info.argv, "host_cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "machine": {**machine_before, "loadavg_at_end": loadavg()},
            **result,
        }
        ok = True
        return result
    finally:
        if ok and not keep:
            shutil.rmtree(work_dir, ignore_errors=True)  # the given --log-path is never removed
        elif not ok:
            console.print(f"kept for inspection: {work_dir}", markup=False, style="dim")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-nodes", type=int, default=16, help="ranks to start on this machine (default 16)")
    p.add_argument("--iterations", type=int, default=5, help="--max-iterations of the run (default 5)")
    p.add_argument("--log-path", type=Path, default=None,
                   help="the run's log path; absent or empty (default: a fresh temp dir, removed afterwards)")
    p.add_argument("--out", "--json-out", dest="json_out", type=Path, default=DEFAULT_JSON_OUT, help=f"default {DEFAULT_JSON_OUT.relative_to(REPO)}")
    p.add_argument("--poll-max-s", type=float, default=None, help="coordination.poll_max_s (default: the product's)")
    p.add_argument("--work-s", type=float, default=0.0, help="rehearsal.work_s (default 0: wall time = overhead)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="stop the run and fail after this long (default 600)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (ranks' output, default log path)")
    p.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this first")
    p.add_argument("--max-wait-s", type=float, default=1200.0)
    a = p.parse_args(argv)
    if a.num_nodes < 1 or a.iterations < 1:
        p.error("--num-nodes and --iterations must be at least 1")
    wait_for_quiet(a.max_load, a.max_wait_s)
    console.print(f"running {a.num_nodes} ranks x {a.iterations} iterations ...", markup=False)
    try:
        result = run_bench(a.num_nodes, a.iterations, a.log_path, poll_max_s=a.poll_max_s, work_s=a.work_s,
                           timeout_s=a.timeout_s, keep=a.keep)
    except BenchError as e:
        Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 132).print(f"barrier_latency: error: {e}", markup=False)
        return 1
    render(result)
    a.json_out.parent.mkdir(parents=True, exist_ok=True)
    a.json_out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {a.json_out}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
