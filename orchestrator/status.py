"""A snapshot of a run, read from the shared filesystem: what `orchestrator status` shows.

Heartbeat ages are measured without comparing two machines' clocks: status writes a probe
file next to the heartbeats and compares the two mtimes, both stamped by the same file
server (on a local disk, by this machine).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from orchestrator import fsio, identity, lease as lease_mod, summary
from orchestrator.config import CoordinationConfig
from orchestrator.errors import ROOT_CAUSE_KINDS, BadInput
from orchestrator.layout import RunLayout
from orchestrator.liveness import TERMINAL_STATES



def _server_now(directory: Path) -> float | None:
    probe = directory / f".status-probe.{identity.host()}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    try:
        probe.write_bytes(b"")
        return probe.stat().st_mtime
    except OSError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def snapshot(log_path: Path) -> dict:
    layout = RunLayout(log_path)
    current = lease_mod.read_lease(layout)
    if current is None:
        raise BadInput(f"no run found under {log_path} (no control/lease.json): is --log-path right?")
    attempt = layout.attempt(current.attempt)
    start = fsio.read_record(attempt.start) or {}
    master_join = fsio.read_record(attempt.join(0)) or {}
    fp = start.get("fingerprint") or master_join.get("fingerprint") or {}
    num_nodes = start.get("num_nodes") or fp.get("num_nodes") or 1
    node_timeout = (start.get("coordination") or {}).get("node_timeout_s", CoordinationConfig().node_timeout_s)
    now = _server_now(attempt.root)
    ranks = []
    for r in range(num_nodes):
        hb = fsio.read_record(attempt.heartbeat(r))
        join = fsio.read_record(attempt.join(r)) or {}
        mtime = _mtime(attempt.heartbeat(r))
        age = round(max(0.0, now - mtime), 3) if (now is not None and mtime is not None) else None
        state = hb.get("state") if hb else "absent"
        alive = bool(hb) and state not in TERMINAL_STATES and age is not None and age < node_timeout
        ranks.append({
            "rank": r,
            "host": (hb or join).get("host"),
            "pid": (hb or join).get("pid"),
            "alive": alive,
            "state": state,
            "iteration": hb.get("iteration") if hb else None,
            "phase": hb.get("phase") if hb else None,
            "progress": hb.get("progress") if hb else None,
            "heartbeat_age_s": age,
        })
    progress = fsio.read_record(layout.progress)
    last = progress["iteration"] if progress else 0
    if any(r["iteration"] for r in ranks):
        last = max(last, max(r["iteration"] or 0 for r in ranks))
    iterations = []
    for i in range(1, last + 1):
        s = summary.read(layout, i)
        if s is not None:
            iterations.append({k: s.get(k) for k in ("iteration", "tasks_per_rank", "trajectories", "evaluated", "metrics", "checkpoint", "complete")})
    return {
        "log_path": str(log_path),
        "attempt": current.attempt,
        "master": {"host": current.host, "pid": current.pid, "generation": current.generation, "released": current.released},
        "num_nodes": num_nodes,
        "rl_phase": start.get("rl_phase") or fp.get("rl_phase"),
        "max_iterations": fp.get("max_iterations"),
        "last_released": progress,
        "ranks": ranks,
        "failure": root_cause(attempt, num_nodes),
        "iterations": iterations,
    }


def root_cause(attempt, num_nodes: int) -> dict | None:
    """The first observed failure of the attempt: the master's abort if it wrote one, else a
    rank's own failure record, else a rank's report of a peer it lost."""
    abort = fsio.read_record(attempt.abort)
    if abort is not None:
        c = abort["culprit"]
        return {k: c.get(k) for k in ("rank", "host", "iteration", "phase", "kind", "error")}
    records = [(r, fsio.read_record(attempt.failure(r))) for r in range(num_nodes)]
    records = [(r, f) for r, f in records if f is not None]
    for r, f in records:
        if f.get("kind") in ROOT_CAUSE_KINDS:
            return {"rank": r, "host": f.get("host"), "iteration": f.get("iteration"), "phase": f.get("phase"),
                    "kind": f.get("kind"), "error": f.get("error")}
    for r, f in records:
        if f.get("culprit"):
            c = f["culprit"]
            return {k: c.get(k) for k in ("rank", "host", "iteration", "phase", "kind", "error")}
    return None
