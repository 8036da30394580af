"""The protocol at a thousand ranks: idle load, operations per barrier round, barrier latency
and dead-rank detection, with N simulated ranks on one machine.

    python bench/scale.py                               # N = 64, 256, 1024
    python bench/scale.py --num-nodes 64 --window-s 10  # quicker
    python bench/scale.py --no-strace                   # latency and detection only

Each simulated rank is the protocol's own code (``coordination.coordinator.Coordinator``: lease,
join, heartbeat, monitor, barriers, abort) run in a thread, with its work a sleep; ranks share
a few processes (``--ranks-per-process``; the master alone in the first, the last rank alone in
the last, which is killed), started one after another: the master, then each process once the
ranks of the one before have joined. How ranks are driven: each rank's main thread walks the
barriers itself, but its heartbeat and monitor threads are replaced by one driver thread per
process that calls every rank's ``Heartbeat.beat()`` each heartbeat interval and
``Monitor.step()`` each poll interval, ranks' phases spread over the period (the protocol's
code still does every file operation; only the threading is simulated: 3,000 threads under
strace on 2 cores starved). Each process has its own host name
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
1 s before it closes, divided by its length: working, from the last worker's start of its work
to the first one's end of it; waiting, from the last waiting rank's arrival to the first
release. Prints a table, writes JSON (default
bench/results/scale.json) and a projection to 1,000 and 10,000 ranks from the per-rank rates.
"""

from __future__ import annotations

import argparse
import copy
import functools
import heapq
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import opcount  # noqa: E402
from bench.common import RESULTS, err_console, machine, table, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "scale.json"
NODE_TIMEOUT_S = 30.0
PHASES_WITH_BARRIERS = 12
RANK_START_SPACING_S = 0.005
"""Between two ranks' starts in one process: their first polls (2 ms apart, doubling) do not all fall together."""
SWITCH_INTERVAL_S = 0.05
"""The GIL's switch interval in a process of simulated ranks (Python's default: 5 ms)."""


# -- a simulated rank ------------------------------------------------------------------------

def _config(rank: int, num_nodes: int, log_path: Path, data_path: Path, node_timeout_s: float):
    """Rank ``rank``'s configuration: a copy of the one this process validated (a RunConfig's
    checks cost O(num_nodes^2), 12 ms at 1,024 ranks: not to be paid by every thread)."""
    config = copy.copy(_validated_config(num_nodes, log_path, data_path, node_timeout_s))
    config.rank = rank
    return config


@functools.lru_cache(maxsize=None)
def _validated_config(num_nodes: int, log_path: Path, data_path: Path, node_timeout_s: float):
    from orchestrator.config import CoordinationConfig, RLPhase, RunConfig, WorkloadKind

    return RunConfig(data_path=data_path, log_path=log_path, rl_phase=RLPhase.BOTH, rank=0, num_nodes=num_nodes,
                     rank_weights=(1.0,) * num_nodes, eval_interval=1, workload=WorkloadKind.REHEARSAL,
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
    from orchestrator.protocol.wire import HeartbeatState
    from orchestrator.coordination.coordinator import Coordinator
    from orchestrator.protocol.waiting import CancelToken, Deadline

    last = num_nodes - 1
    points = _points(rounds)
    coord = None

    def barrier(work_s: float, then: str | None = None) -> None:
        """Work ``work_s`` seconds, say ``then`` (if any), and arrive."""
        assert coord is not None
        iteration, phase = next(points)
        coord.set_position(iteration, phase, Deadline.after(900, "bench work"))
        if work_s:
            coord.cancel.sleep(work_s)
        if then:
            emit(then, rank)
        coord.barrier(iteration, phase, {}, Deadline.after(900, "bench barrier"), lambda payloads: {})

    try:
        coord = Coordinator(_config(rank, num_nodes, log_path, data_path, node_timeout_s), CancelToken(), Children())
        coord.join(lambda: (1, Phase.SYNC_START, None, ()))
        barrier(0)
        barrier(0)
        emit("working", rank)
        barrier(window_s if rank != 0 else 0, then="worked" if rank != 0 else None)
        barrier(window_s if rank == last else 0, then="arrived" if rank != last else None)
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


# -- one thread drives every rank's heartbeat and monitor -----------------------------------

_GOLDEN = 0.6180339887498949


def _phase(rank: int) -> float:
    """Where in its period a rank's first beat or look falls, in [0, 1): spread evenly over any
    run of consecutive ranks, so a process's ranks never all beat at one instant."""
    return (rank * _GOLDEN) % 1.0


class _Driven:
    """A rank's heartbeat or monitor on the driver's schedule. ``lock`` is held while the
    driver beats or steps it: ``Heartbeat.close`` and ``Monitor.halt`` take it after setting
    their stop flag, as the threads' ``join`` waits for a beat or a look under way."""

    __slots__ = ("call", "period", "kind", "lock")

    def __init__(self, call, period: float, kind: str):
        self.call = call  # () -> bool: True while it is to be driven on
        self.period = period
        self.kind = kind  # "beat" or "look"
        self.lock = threading.Lock()


class Driver:
    """One thread that does, on a schedule, what each rank's heartbeat thread and monitor
    thread do: ``Heartbeat.beat()`` every heartbeat interval and ``Monitor.step(now)`` every
    ``poll_s``, until the heartbeat is closed or the monitor halted, cancelled, or done (step
    returned True).

    As in those threads, the next call comes a period after the last one ended (a worker's
    monitor skips its read of the master's heartbeat when the last one is younger than a
    period: a shorter gap would skip reads the threads make). Ranks' first calls are spread
    over a period. Beats that are due go before looks that are due, as a rank's heartbeat
    thread does not wait for its monitor. How late the calls came is logged every
    ``report_s`` (stderr: the process's log, kept with ``--keep``)."""

    def __init__(self, report_s: float = 30.0):
        self._queues: dict[str, list[tuple[float, int, _Driven]]] = {"beat": [], "look": []}
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._report_s = report_s
        self.thread = threading.Thread(target=self._run, name="driver", daemon=True)
        self.thread.start()

    def add(self, driven: _Driven, first_in: float) -> None:
        with self._cv:
            heapq.heappush(self._queues[driven.kind], (time.monotonic() + first_in, next(self._seq), driven))
            self._cv.notify()

    def _next(self) -> tuple[float, _Driven]:
        with self._cv:
            while True:
                now = time.monotonic()
                for queue in self._queues.values():  # beats first
                    if queue and queue[0][0] <= now:
                        due, _, driven = heapq.heappop(queue)
                        return due, driven
                soonest = min((q[0][0] for q in self._queues.values() if q), default=None)
                self._cv.wait(None if soonest is None else soonest - now)

    def _run(self) -> None:
        calls = {"beat": 0, "look": 0}
        late = {"beat": 0.0, "look": 0.0}
        began = time.monotonic()
        report_at = began + self._report_s
        while True:
            due, driven = self._next()
            now = time.monotonic()
            late[driven.kind] = max(late[driven.kind], now - due)
            with driven.lock:
                try:
                    again = driven.call()
                except Exception:  # noqa: BLE001 - as a rank's thread would, it dies with a traceback
                    traceback.print_exc()
                    again = False
            calls[driven.kind] += 1
            if again:  # a period after this call ended, as the thread's wait after each call
                with self._cv:
                    heapq.heappush(self._queues[driven.kind], (time.monotonic() + driven.period, next(self._seq), driven))
            if now >= report_at:
                with self._cv:
                    driven_now = {k: len(q) for k, q in self._queues.items()}
                print(f"driver, {now - began:.0f} s: {calls['beat']} beats ({driven_now['beat']} heartbeats), latest {late['beat']:.2f} s late; "
                      f"{calls['look']} looks ({driven_now['look']} monitors), latest {late['look']:.2f} s late",
                      file=sys.stderr, flush=True)
                calls = {"beat": 0, "look": 0}
                late = {"beat": 0.0, "look": 0.0}
                report_at = now + self._report_s

    def wait_for(self, driven: _Driven | None, timeout: float) -> None:
        """Until a beat or look of ``driven`` under way ends (not from the driver itself)."""
        if driven is not None and threading.current_thread() is not self.thread and driven.lock.acquire(timeout=timeout):
            driven.lock.release()


def drive_ranks_from_one_thread() -> Driver:
    """Replace every rank's heartbeat thread and monitor thread in this process by one
    :class:`Driver`. The protocol's code does every file operation (``Heartbeat.beat``,
    ``Monitor.step``); only who calls it, and when, is the bench's."""
    from orchestrator.coordination.heartbeat import Heartbeat
    from orchestrator.coordination.monitor import Monitor

    driver = Driver()
    close = Heartbeat.close

    def heartbeat_start(self) -> None:
        self.beat()

        def beat() -> bool:
            if self._stop.is_set():
                return False
            self.beat()
            return True

        self._driven = _Driven(beat, self._interval, "beat")
        driver.add(self._driven, self._interval * _phase(self._state["rank"]))

    def heartbeat_close(self, state: str) -> None:
        self._stop.set()
        driver.wait_for(getattr(self, "_driven", None), self._interval + 1)
        close(self, state)

    def monitor_start(self) -> None:
        halt, thread = self._halt, self._thread  # rearm replaces both: this watch ends with its own

        def look() -> bool:
            if halt.is_set() or self.cancel.reason is not None or self._thread is not thread:
                return False
            return not self.step(time.monotonic())

        self._driven = _Driven(look, self.poll_s, "look")
        driver.add(self._driven, self.poll_s * _phase(self.rank))

    def monitor_halt(self) -> None:
        self._halt.set()
        driver.wait_for(getattr(self, "_driven", None), 5)

    def monitor_rearm(self, cancel) -> None:
        self.halt()
        self.cancel = cancel
        self._new_thread()  # a fresh halt event (its thread object is never started)
        self.start()

    Heartbeat.start, Heartbeat.close = heartbeat_start, heartbeat_close
    Monitor.start, Monitor.halt, Monitor.rearm = monitor_start, monitor_halt, monitor_rearm
    return driver


def child(first: int, last: int, num_nodes: int, log_path: Path, data_path: Path, window_s: float, rounds: int,
          node_timeout_s: float = NODE_TIMEOUT_S, kill: bool = True) -> int:
    from orchestrator.node import gpus
    from orchestrator.coordination import startup

    # Start-up facts a thousand threads need not gather (nvidia-smi, versions): not protocol.
    facts = gpus.detect()
    gpus.detect = lambda *a, **k: facts
    startup.quick_facts = lambda *a, **k: None
    # Many ranks' threads wanting the GIL at once (every worker parses the 1,024-rank start.json,
    # 280 KB, within a second) each wake every switch interval to ask for it: at 5 ms, that
    # herd spent several times the parsing's own CPU in the kernel and held every process's
    # driver off for 30 s. A rank alone in its process never meets it; fewer wake-ups here.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    drive_ranks_from_one_thread()
    lock = threading.Lock()

    def emit(what: str, rank: int, **extra) -> None:
        with lock:
            print(json.dumps({"t": time.time(), "what": what, "rank": rank, **extra}), flush=True)

    emit("pid", first, pid=os.getpid())  # under strace the bench holds the tracer's pid, not this one

    threads = [threading.Thread(target=_rank, args=(r, num_nodes, log_path, data_path, window_s, rounds, emit, node_timeout_s, kill),
                                daemon=True)
               for r in range(first, last + 1)]
    for t in threads:
        t.start()
        time.sleep(RANK_START_SPACING_S)
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
    procs: list[subprocess.Popen] = []
    events: list[dict] = []
    lock = threading.Lock()
    victim_ready = threading.Event()
    pids: dict[int, int] = {}  # process index -> the simulated ranks' process (strace's child)
    readers = []

    def read(i, p):
        for line in p.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e["what"] == "pid":
                pids[i] = e["pid"]
                continue
            with lock:
                events.append(e)
            if e["what"] == "victim":
                victim_ready.set()

    def launch(i: int) -> None:
        first, last = groups[i]
        argv = [sys.executable, __file__, "--child", f"{first}:{last}", "--num-nodes", str(num_nodes), "--log-path", str(log_path),
                "--data-path", str(data_path), "--window-s", str(window_s), "--rounds", str(rounds),
                "--node-timeout-s", str(node_timeout_s), *([] if kill else ["--no-kill"])]
        if trace:
            argv = [*opcount.prefix(traces / f"p{i}"), *argv]
        env = {**os.environ, "ORCHESTRATOR_HOST": f"sim-{i}", "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(work / f"p{i}.log", "w"), env=env, text=True))
        readers.append(threading.Thread(target=read, args=(i, procs[-1]), daemon=True))
        readers[-1].start()

    def kill_process(i: int) -> None:
        """SIGKILL process ``i``'s ranks: the process itself, not only strace (a tracee outlives
        its tracer, its traced calls then failing with ENOSYS)."""
        if i in pids:
            try:
                os.kill(pids[i], signal.SIGKILL)
            except ProcessLookupError:
                pass
        procs[i].kill()

    started = time.time()
    killed_at = None

    def wait_until(done, what: str) -> None:
        """Poll ``done()`` (the bench's own look at the run directory, not traced) until it
        holds; fail at once when a rank failed, a process ended, or the time is up."""
        while not done():
            failed = [e for e in events if e["what"].startswith("error") or e["what"] == "peer-failed"]
            ended = [i for i, p in enumerate(procs) if p.poll() is not None]
            for i in ended:
                readers[i].join(timeout=5)  # what it said before it ended
            if ended and done():
                return
            if failed or ended or time.time() - started > timeout_s:
                why = failed[:1] or [f"process {i} (ranks {groups[i][0]}-{groups[i][1]}) ended, exit status {procs[i].returncode}"
                                     for i in ended][:1] or [f"not within {timeout_s:g} s"]
                raise RuntimeError(f"N={num_nodes}: the ranks did not reach {what} ({why[0]}; logs in {work})")
            time.sleep(0.1)

    def joined(first: int, last: int) -> bool:
        names = set()
        for joins in log_path.glob("attempts/*/joins"):
            names.update(os.listdir(joins))
        return all(f"r{r:05d}.json" in names for r in range(first, last + 1))

    try:
        # Staggered start-up: the master first; each next process once the ranks of the one
        # before have joined (10 Python start-ups and 1,000 joins at once saturate 2 cores
        # under strace, and a starved process stops beating).
        launch(0)
        wait_until((log_path / "control" / "lease.json").exists, "the master's lease")
        for i in range(1, len(groups)):
            launch(i)
            wait_until(lambda: joined(*groups[i]), f"the joins of ranks {groups[i][0]}-{groups[i][1]}")
        wait_until(victim_ready.is_set, "the kill point")
        if kill:
            time.sleep(1.0)  # the others arrive at the last barrier
            killed_at = time.time()
            kill_process(len(procs) - 1)
        for p in procs[:-1] if kill else procs:
            p.wait(timeout=max(1.0, timeout_s - (time.time() - started)))
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                kill_process(i)
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

        result["working"] = window(last("working"), first("worked"))  # every worker works
        result["waiting"] = window(last("arrived"), first("rounds"))  # all but the last rank wait
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
