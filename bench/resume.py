"""Resume after a crash mid-rollout vs redoing the iteration, on a real RL run of the demo.

    python bench/resume.py                                  # makes demo data in a temp dir first
    python bench/resume.py --data-path /tmp/orch-data      # reuse demo data (orchestrator demo-data)

Three ranks on this machine, each its own ``orchestrator run`` (weights 2,1,1; the embedded
engine on CPU; ``rl.train_tasks=192``, 4 samples each, 16 eval tasks, one iteration; the
settings of tests/system/test_rl_loop.py's kill test, with ``rollout.engine_port=0``):

from scratch  a fresh log path: the cost of redoing the iteration, which is what the
              reference does after any crash (its shards are not resumable)
crash         a fresh log path; once rank 0 (the master, 96 of the 192 tasks) is part-way
              through its rollout (``--kill-at``: half of its tasks by default), ``kill -9`` it (its engine dies with it: death signal);
              the workers see the master's heartbeat stop and exit 3 after
              ``coordination.node_timeout_s`` (10 s here, 180 s by default)
resume        the same three commands again on the crashed log path

For "from scratch" and "resume", from the launch of the ranks:

    first new trajectory   rank 0's shard (``iterations/000001/rollout/train/r00000.jsonl``)
                           holds more complete records than at the launch (polled every
                           10 ms; records reach the file in flushed batches)
    rollout sealed         the last rank's ``arrive`` at ``rollout_done`` (event logs)
    iteration done         the last rank's ``end`` event

and the records each run generated (a resumed rank keeps its complete records and generates
only the missing task ids), and when each phase was released. The three runs are done
--repeats times (training, three torch processes on this machine's cores, varies by several
seconds from run to run); the table gives medians. Writes JSON (default bench/results/resume.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS,
    BenchError,
    console,
    err_console,
    kill_tree,
    loadavg,
    machine,
    python_env,
    table,
    wait_for_quiet,
    write_json,
)
from orchestrator.phase_table import Phase  # noqa: E402
from orchestrator.protocol import fsio  # noqa: E402
from orchestrator.protocol.events import read_events  # noqa: E402
from orchestrator.protocol.layout import RunLayout  # noqa: E402

DEFAULT_OUT = RESULTS / "resume.json"
NUM_NODES = 3
WEIGHTS = "2,1,1"
SETTINGS = [
    "rl.train_tasks=192", "rl.samples_per_prompt=4", "rl.eval_tasks=16", "rl.eval_samples=2", "rl.epochs=1",
    "rl.micro_batch=4", "coordination.heartbeat_interval_s=0.5", "coordination.node_timeout_s=10",
    "coordination.join_timeout_s=120", "rollout.engine_port=0",
]


def flags(data: Path, log_path: Path) -> list[str]:
    return [f"--data-path={data}", f"--log-path={log_path}", "--rl-phase=both", f"--num-nodes={NUM_NODES}",
            f"--rank-weights={WEIGHTS}", "--eval-interval=1", "--max-iterations=1", *SETTINGS]


def start(data: Path, log_path: Path, out_dir: Path, tag: str) -> list[subprocess.Popen]:
    procs = []
    for r in range(NUM_NODES):
        with open(out_dir / f"{tag}.r{r}.log", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "run", *flags(data, log_path), "--master" if r == 0 else f"--worker={r}"],
                stdout=out, stderr=subprocess.STDOUT, env=python_env(), start_new_session=True))
    return procs


def complete_records(shard: Path) -> int:
    try:
        data = shard.read_bytes()
    except FileNotFoundError:
        return 0
    return data.count(b"\n")  # lines are appended whole and flushed in batches; a torn tail has no newline


def _attempt(layout: RunLayout) -> str | None:
    lease = fsio.read_record(layout.lease)
    return lease["attempt"] if lease else None


def watch(procs, layout: RunLayout, launched: float, timeout_s: float, *, kill_at: float | None = None) -> dict:
    """Poll until the ranks exit; note when rank 0's shard first grows (and, with ``kill_at``,
    SIGKILL rank 0 once its heartbeat shows at least that share of its rollout done)."""
    shard = layout.iteration(1).shard("train", 0)
    at_launch = complete_records(shard)
    first_new = killed = None
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise BenchError(f"the ranks did not finish within {timeout_s:g} s")
        if first_new is None and complete_records(shard) > at_launch:
            first_new = time.monotonic() - launched
        if kill_at is not None and killed is None:
            attempt = _attempt(layout)
            hb = fsio.read_record(layout.attempt(attempt).heartbeat(0)) if attempt else None
            p = hb and hb.get("phase") == Phase.ROLLOUT.label and hb.get("progress")
            if p and kill_at * p["total"] <= p["done"] < p["total"]:
                os.kill(procs[0].pid, signal.SIGKILL)
                killed = {"after_s": time.monotonic() - launched, "progress": p}
        time.sleep(0.01)
    return {"records_at_launch": at_launch, "first_new_trajectory_s": first_new, "killed": killed,
            "exit_codes": [p.returncode for p in procs]}


def timeline(layout: RunLayout, launched_wall: float) -> dict:
    """From the launch (wall clock): the last rank's arrive at rollout_done, the last end."""
    attempt = _attempt(layout)
    events = {r: read_events(layout.attempt(attempt).events(r)) for r in range(NUM_NODES)}
    arrive = [e["t"] for ev in events.values() for e in ev
              if e["event"] == "arrive" and e.get("iteration") == 1 and e.get("phase") == int(Phase.ROLLOUT_DONE)]
    ends = [e["t"] for ev in events.values() for e in ev if e["event"] == "end"]
    first = min(e["t"] for ev in events.values() for e in ev)
    released: dict[int, float] = {}  # phase -> the last rank's release, from the launch
    for ev in events.values():
        for e in ev:
            if e["event"] == "released" and e.get("iteration") == 1:
                released[e["phase"]] = max(released.get(e["phase"], 0.0), e["t"] - launched_wall)
    return {"attempt": attempt, "joined_s": first - launched_wall,
            "released_s": {Phase(p).label: round(t, 3) for p, t in sorted(released.items())},
            "rollout_sealed_s": max(arrive) - launched_wall if len(arrive) == NUM_NODES else None,
            "iteration_done_s": max(ends) - launched_wall if len(ends) == NUM_NODES else None}


def run_phase(name: str, data: Path, log_path: Path, out_dir: Path, timeout_s: float, **kw) -> dict:
    layout = RunLayout(log_path)
    shards_before = {r: complete_records(layout.iteration(1).shard("train", r)) for r in range(NUM_NODES)}
    console.print(f"{name} ...", markup=False)
    wall0, mono0 = time.time(), time.monotonic()
    procs = start(data, log_path, out_dir, name)
    try:
        out = watch(procs, layout, mono0, timeout_s, **kw)
    finally:
        for p in procs:
            kill_tree(p, term_grace_s=5)
    out["shard_records_after"] = {r: complete_records(layout.iteration(1).shard("train", r)) for r in range(NUM_NODES)}
    out["records_generated"] = sum(out["shard_records_after"][r] - shards_before[r] for r in range(NUM_NODES))
    out["wall_s"] = time.monotonic() - mono0
    if kw.get("kill_at") is None:
        out.update(timeline(layout, wall0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", type=Path, default=None, help="demo data (default: made with --warm-steps 100 in the temp dir)")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="kill rank 0 once this share of its rollout is done (default 0.5; progress moves in batches of 16)")
    p.add_argument("--repeats", type=int, default=3, help="times to do the three runs (default 3; medians shown)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run of the three ranks")
    p.add_argument("--max-load", type=float, default=None, help="wait for a 1-minute load average below this first")
    p.add_argument("--max-wait-s", type=float, default=1200.0)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="resume-", dir=a.work_dir))
    ok = False
    try:
        data = a.data_path
        if data is None:
            data = work / "data"
            console.print("making demo data (orchestrator demo-data --warm-steps 100) ...", markup=False)
            r = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={data}", "--warm-steps=100"],
                               capture_output=True, text=True, env=python_env(), timeout=600)
            if r.returncode != 0:
                raise BenchError(f"demo-data failed: {r.stderr[-2000:]}")
        load = wait_for_quiet(a.max_load, a.max_wait_s)
        result = {"machine": machine(), "loadavg_at_start": load, "settings": flags(Path("D"), Path("L")), "runs": {}}
        for k in range(a.repeats):
            scratch = run_phase("from scratch", data, work / f"scratch{k}", work, a.timeout_s)
            if scratch["exit_codes"] != [0] * NUM_NODES:
                raise BenchError(f"the run from scratch failed: exits {scratch['exit_codes']}; logs in {work}")
            crash = run_phase("crash", data, work / f"crashed{k}", work, a.timeout_s, kill_at=a.kill_at)
            if crash["killed"] is None or crash["exit_codes"] != [-9, 3, 3]:
                raise BenchError(f"the crash run did not go as planned: killed {crash['killed']}, exits {crash['exit_codes']}")
            resumed = run_phase("resume", data, work / f"crashed{k}", work, a.timeout_s)
            if resumed["exit_codes"] != [0] * NUM_NODES:
                raise BenchError(f"the resumed run failed: exits {resumed['exit_codes']}; logs in {work}")
            result["runs"].setdefault("from_scratch", []).append(scratch)
            result["runs"].setdefault("crash", []).append(crash)
            result["runs"].setdefault("resume", []).append(resumed)
            write_json(a.out, result)
        result["machine"]["loadavg_at_end"] = loadavg()
        ok = True
    except (BenchError, subprocess.TimeoutExpired) as e:
        err_console.print(f"resume: error: {e}", markup=False)
        return 1
    finally:
        if ok and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:
            console.print(f"kept: {work}", markup=False, style="dim")

    def s(v):
        return "-" if v is None else f"{v:.1f}"

    keys = ("first_new_trajectory_s", "rollout_sealed_s", "iteration_done_s")
    result["median"] = {run: {k: statistics.median(r[k] for r in result["runs"][run]) for k in keys}
                        for run in ("from_scratch", "resume")}
    rows = []
    for label, run in (("redo the iteration (from scratch)", "from_scratch"), ("resume after kill -9", "resume")):
        runs, med = result["runs"][run], result["median"][run]
        rows.append([label, *(f"{med[k]:.1f} ({', '.join(s(r[k]) for r in runs)})" for k in keys),
                     runs[0]["records_at_launch"], runs[0]["records_generated"]])
    kills = ", ".join(f"{c['killed']['after_s']:.1f} s in at {c['killed']['progress']['done']}/{c['killed']['progress']['total']}"
                      for c in result["runs"]["crash"])
    table(f"from launch (s), median (each run); rank 0 killed {kills} tasks",
          ["run", "first new trajectory", "rollout sealed", "iteration done", "rank 0 records at launch", "records generated"], rows)
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
