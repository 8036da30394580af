"""The protocol at a thousand ranks: idle load, operations per barrier round, barrier latency
and dead-rank detection, with N simulated ranks on one machine.

    python bench/scale.py                               # N = 64, 256, 1024
    python bench/scale.py --num-nodes 64 --window-s 10  # quicker
    python bench/scale.py --no-strace                   # latency and detection only

Each simulated rank is the protocol's own code (``protocol.coordinator.Coordinator``: lease,
join, heartbeat thread, monitor thread, barriers, abort) run in a thread, with its work a
sleep; ranks share a few processes (``--ranks-per-process``; the master alone in the first,
the last rank alone in the last, which is killed). Each process has its own host name
(``ORCHESTRATOR_HOST``), so only the threads of one process count as one host: same-host
wake-ups play no part across processes, as across the nodes of a cluster. The run directory
is a local directory (``--dir``: put it on a mount to measure another filesystem). Every
process runs under strace (bench/opcount.py), which counts the calls that reach the run
directory: metadata operations are lookups by name (open, stat, rename, mkdir, unlink) and
calls on a descriptor (fstat, directory listings); fsyncs apart.

What every rank does, one after another, with ``coordination.node_timeout_s`` = 30 (the other
settings default: heartbeat 5 s, watch interval 1 s):

    warm-up    two barriers;
    working    the workers work ``--window-s`` seconds, the master waits at the barrier for all
               of them: the idle load while a phase's work runs;
    waiting    the last rank works ``--window-s`` seconds, all others wait at the barrier: the
               idle load of a barrier wait (every worker polls the master's heartbeat);
    rounds     ``--rounds`` barriers back to back, no work: latency from the last arrival to the
               last rank's release, and operations per round per rank;
    kill       every rank arrives at one more barrier but the last, whose process is killed
               (SIGKILL) instead: the time until the master's ``abort.json`` names it.

The idle load of a window counts every call of every rank from 2 s after the window opens to
1 s before it closes, divided by its length. Prints a table, writes JSON (default
bench/results/scale.json) and a projection to 1,000 and 10,000 ranks from the per-rank rates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import opcount  # noqa: E402
from bench.common import RESULTS, err_console, machine, table, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "scale.json"
NODE_TIMEOUT_S = 30.0
PHASES_WITH_BARRIERS = 12


# -- a simulated rank ------------------------------------------------------------------------

def _config(rank: int, num_nodes: int, log_path: Path, data_path: Path, node_timeout_s: float):
    from orchestrator.config import CoordinationConfig, RLPhase, RunConfig, Workload

    return RunConfig(data_path=data_path, log_path=log_path, rl_phase=RLPhase.BOTH, rank=rank, num_nodes=num_nodes,
                     rank_weights=(1.0,) * num_nodes, eval_interval=1, workload=Workload.REHEARSAL,
                     coordination=CoordinationConfig(node_timeout_s=node_timeout_s, join_timeout_s=600.0))


def _points(rounds: int):
    """The barrier points walked: (iteration, phase), phases in order, iterations counting up."""
    from orchestrator.phase_table import Phase

    phases = [p for p in Phase][:PHASES_WITH_BARRIERS]
    k = 0
    while True:
        yield 1 + k // len(phases), phases[k % len(phases)]
        k += 1


def _rank(rank: int, num_nodes: int, log_path: Path, data_path: Path, window_s: float, rounds: int, emit,
          node_timeout_s: float = NODE_TIMEOUT_S, kill: bool = True) -> None:
    from orchestrator.errors import PeerFailed
    from orchestrator.node.procs import Children
    from orchestrator.phase_table import Phase
    from orchestrator.protocol.api import HeartbeatState
    from orchestrator.protocol.coordinator import Coordinator
    from orchestrator.protocol.waiting import CancelToken, Deadline

    last = num_nodes - 1
    points = _points(rounds)
    coord = None

    def barrier(work_s: float) -> None:
        assert coord is not None
        iteration, phase = next(points)
        coord.set_position(iteration, phase, Deadline.after(900, "bench work"))
        if work_s:
            coord.cancel.sleep(work_s)
        coord.barrier(iteration, phase, {}, Deadline.after(900, "bench barrier"), lambda payloads: {})

    try:
        coord = Coordinator(_config(rank, num_nodes, log_path, data_path, node_timeout_s), CancelToken(), Children())
        coord.join(lambda: (1, Phase.SYNC_START, None))
        barrier(0)
        barrier(0)
        emit("working", rank)
        barrier(window_s if rank != 0 else 0)
        emit("waiting", rank)
        barrier(window_s if rank == last else 0)
        emit("rounds", rank)
        for _ in range(rounds):
            barrier(0)
        emit("kill", rank)
        if rank == last:
            emit("victim", rank)
            if kill:
                threading.Event().wait()  # the bench kills this process
        barrier(0)
        if kill:
            emit("error: released without the killed rank", rank)
        else:
            emit("done", rank)
            coord.close(HeartbeatState.DONE)
    except PeerFailed as e:
        emit("peer-failed", rank, culprit=e.culprit.rank)
        coord.close(HeartbeatState.FAILED)
    except BaseException as e:  # noqa: BLE001 - reported, the bench fails
        emit(f"error: {type(e).__name__}: {e}", rank)


def child(first: int, last: int, num_nodes: int, log_path: Path, data_path: Path, window_s: float, rounds: int,
          node_timeout_s: float = NODE_TIMEOUT_S, kill: bool = True) -> int:
    from orchestrator.node import gpus
    from orchestrator.protocol import startup

    # Start-up facts a thousand threads need not gather (nvidia-smi, versions): not protocol.
    facts = gpus.detect()
    gpus.detect = lambda *a, **k: facts
    startup.quick_facts = lambda *a, **k: None
    lock = threading.Lock()

    def emit(what: str, rank: int, **extra) -> None:
        with lock:
            print(json.dumps({"t": time.time(), "what": what, "rank": rank, **extra}), flush=True)

    threads = [threading.Thread(target=_rank, args=(r, num_nodes, log_path, data_path, window_s, rounds, emit, node_timeout_s, kill),
                                daemon=True)
               for r in range(first, last + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


# -- the bench -------------------------------------------------------------------------------

def _groups(num_nodes: int, per_process: int) -> list[tuple[int, int]]:
    """Rank ranges per process: the master alone, the workers in groups, the victim alone."""
    groups = [(0, 0)]
    r = 1
    while r < num_nodes - 1:
        groups.append((r, min(r + per_process, num_nodes - 1) - 1))
        r += per_process
    groups.append((num_nodes - 1, num_nodes - 1))
    return groups


def run_one(num_nodes: int, *, base: Path, window_s: float, rounds: int, per_process: int, trace: bool,
            timeout_s: float, keep: bool = False, kill: bool = True, node_timeout_s: float = NODE_TIMEOUT_S) -> dict:
    """One bench run of ``num_nodes`` simulated ranks (see the module's docstring); ``kill``:
    end it by killing the last rank (else every rank walks one more barrier and ends)."""
    work = Path(tempfile.mkdtemp(prefix=f"scale{num_nodes}-", dir=base))
    log_path, data_path, traces = work / "run", work / "data", work / "trace"
    data_path.mkdir()
    traces.mkdir()
    groups = _groups(num_nodes, per_process)
    procs = []
    for i, (first, last) in enumerate(groups):
        argv = [sys.executable, __file__, "--child", f"{first}:{last}", "--num-nodes", str(num_nodes), "--log-path", str(log_path),
                "--data-path", str(data_path), "--window-s", str(window_s), "--rounds", str(rounds),
                "--node-timeout-s", str(node_timeout_s), *([] if kill else ["--no-kill"])]
        if trace:
            argv = [*opcount.prefix(traces / f"p{i}"), *argv]
        env = {**os.environ, "ORCHESTRATOR_HOST": f"sim-{i}", "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(work / f"p{i}.log", "w"), env=env, text=True))
    events: list[dict] = []
    lock = threading.Lock()
    victim_ready = threading.Event()

    def read(p):
        for line in p.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            with lock:
                events.append(e)
            if e["what"] == "victim":
                victim_ready.set()

    readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
    for t in readers:
        t.start()
    started = time.time()
    killed_at = None
    try:
        while not victim_ready.wait(0.5):
            failed = [e for e in events if e["what"].startswith("error")]
            if failed or time.time() - started > timeout_s or all(p.poll() is not None for p in procs[:-1]):
                raise RuntimeError(f"N={num_nodes}: the ranks did not reach the kill point ({failed[:1]}; logs in {work})")
        if kill:
            time.sleep(1.0)  # the others arrive at the last barrier
            killed_at = time.time()
            procs[-1].send_signal(signal.SIGKILL)
        for p in procs[:-1] if kill else procs:
            p.wait(timeout=max(1.0, timeout_s - (time.time() - started)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for t in readers:
        t.join(timeout=5)
    errors = [e for e in events if e["what"].startswith("error")]
    if errors:
        raise RuntimeError(f"N={num_nodes}: {errors[0]} (logs in {work})")

    def first(what: str) -> float:
        return min(e["t"] for e in events if e["what"] == what)

    def last(what: str) -> float:
        return max(e["t"] for e in events if e["what"] == what)

    result = {"num_nodes": num_nodes, "processes": len(groups), "window_s": window_s, "rounds": rounds,
              "rounds_s": round(first("kill") - last("rounds"), 3)}
    if kill:
        abort = json.loads((next((log_path / "attempts").iterdir()) / "abort.json").read_text())["body"]
        failed = [e for e in events if e["what"] == "peer-failed"]
        result["detection"] = {"named_rank": abort["culprit"]["rank"], "expected_rank": num_nodes - 1,
                               "abort_after_kill_s": round(abort["at"] - killed_at, 2),
                               "last_rank_stopped_after_kill_s": round(max(e["t"] for e in failed) - killed_at, 2),
                               "ranks_stopped": len(failed), "bound_s": node_timeout_s + 2 * 5.0}
    per_round = (first("kill") - last("rounds")) / rounds
    result["round_mean_s"] = round(per_round, 4)
    if trace:
        calls_by_process: dict[int, list] = {i: [] for i in range(len(groups))}
        for i in range(len(groups)):
            for tid, path in opcount.threads(traces / f"p{i}").items():
                calls_by_process[i].extend(opcount.parse(path, [str(log_path)]))

        def window(t0: float, t1: float) -> dict:
            t0, t1 = t0 + 2.0, t1 - 1.0
            master = sum(1 for c in calls_by_process[0] if t0 <= c.t < t1 and c.kind != "fsync")
            workers = sum(1 for i in range(1, len(groups)) for c in calls_by_process[i] if t0 <= c.t < t1 and c.kind != "fsync")
            span = t1 - t0
            return {"seconds": round(span, 1), "ops_per_s": round((master + workers) / span, 1),
                    "master_ops_per_s": round(master / span, 1), "per_worker_ops_per_s": round(workers / span / (num_nodes - 1), 3)}

        result["working"] = window(last("working"), first("waiting"))
        result["waiting"] = window(last("waiting"), first("rounds"))
        r0, r1 = last("rounds"), first("kill")
        in_rounds = [c for i in calls_by_process for c in calls_by_process[i] if r0 <= c.t < r1]
        tally = opcount.tally(in_rounds)
        result["round_ops_per_rank"] = round(tally["metadata"] / rounds / num_nodes, 2)
        result["round_fsyncs_per_rank"] = round(tally["fsync"] / rounds / num_nodes, 2)
        result["round_by_call"] = {k: round(v / rounds / num_nodes, 2) for k, v in tally["by_call"].items()}
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-nodes", type=int, action="append", help="ranks (repeat; default 64, 256, 1024)")
    p.add_argument("--window-s", type=float, default=20.0, help="length of the working and waiting windows")
    p.add_argument("--rounds", type=int, default=24, help="barrier rounds back to back")
    p.add_argument("--ranks-per-process", type=int, default=128)
    p.add_argument("--dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    p.add_argument("--no-strace", action="store_true")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--keep", action="store_true", help="keep the run directories and traces")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--node-timeout-s", type=float, default=NODE_TIMEOUT_S)
    p.add_argument("--no-kill", action="store_true", help="end without killing a rank (no detection figure)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--log-path", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data-path", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        first, last = map(int, a.child.split(":"))
        return child(first, last, a.num_nodes[0], a.log_path, a.data_path, a.window_s, a.rounds, a.node_timeout_s, not a.no_kill)
    trace = not a.no_strace
    if trace and not opcount.available():
        err_console.print("strace is not installed: run with --no-strace, or install it (scripts/setup-dev.sh does)")
        return 2
    base = a.dir or Path(tempfile.gettempdir())
    results = []
    for n in a.num_nodes or [64, 256, 1024]:
        err_console.print(f"N={n} ...")
        results.append(run_one(n, base=base, window_s=a.window_s, rounds=a.rounds, per_process=a.ranks_per_process,
                               trace=trace, timeout_s=a.timeout_s, keep=a.keep, kill=not a.no_kill,
                               node_timeout_s=a.node_timeout_s))
    rows = []
    for r in results:
        d = r.get("detection") or {"abort_after_kill_s": float("nan"), "named_rank": "-"}
        rows.append([r["num_nodes"], r.get("working", {}).get("ops_per_s", "-"), r.get("working", {}).get("per_worker_ops_per_s", "-"),
                     r.get("working", {}).get("master_ops_per_s", "-"), r.get("waiting", {}).get("ops_per_s", "-"),
                     r.get("waiting", {}).get("per_worker_ops_per_s", "-"), r.get("round_ops_per_rank", "-"),
                     f"{r['round_mean_s'] * 1000:.0f}", f"{d['abort_after_kill_s']:.1f} (rank {d['named_rank']})"])
    table("bench/scale.py: simulated ranks, default settings (node_timeout_s 30)", ["ranks", "working ops/s", "per worker", "master", "waiting ops/s", "per worker", "ops/round/rank",
                         "round ms", "killed rank named after s"], rows)
    write_json(a.out, {"machine": machine(), "command": " ".join(sys.argv), "node_timeout_s": a.node_timeout_s, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
