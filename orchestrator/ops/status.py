"""A snapshot of a run, read from the shared filesystem: what `orchestrator status` shows.

Heartbeat ages are measured without comparing two machines' clocks: status writes a probe
file next to the heartbeats and compares the two mtimes, both stamped by the same file
server (on a local disk, by this machine).
"""

from __future__ import annotations

import os
import statistics
import uuid
from pathlib import Path

from orchestrator.config import CoordinationConfig
from orchestrator.data import summary
from orchestrator.errors import ROOT_CAUSE_KINDS, BadInput
from orchestrator.node import identity
from orchestrator.ops import timing
from orchestrator.ops.event_fold import EventReader
from orchestrator.phase_table import Phase, RLPhase
from orchestrator.protocol import fsio
from orchestrator.protocol import lease as lease_mod
from orchestrator.protocol.wire import TERMINAL_STATES
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.membership import Members


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


def snapshot(log_path: Path, events: EventReader | None = None) -> dict:
    """The run's state now. ``events``: a reader kept from the previous snapshot of the same
    run (``--watch``), so that only what the event logs gained since is read."""
    layout = RunLayout(log_path)
    events = events if events is not None else EventReader(layout)
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
    members = Members.read(attempt.members)
    ranks = []
    for r in range(num_nodes):
        hb = fsio.read_record(attempt.heartbeat(r))
        join = fsio.read_record(attempt.join(r)) or {}
        mtime = _mtime(attempt.heartbeat(r))
        age = round(max(0.0, now - mtime), 3) if (now is not None and mtime is not None) else None
        state = hb.get("state") if hb else "absent"
        alive = bool(hb) and state not in TERMINAL_STATES and age is not None and age < node_timeout
        # Time in the phase on the rank's clock, plus the heartbeat's age while it still runs.
        in_phase = round(hb["in_phase_s"] + (age or 0.0 if alive else 0.0), 3) if hb and hb.get("in_phase_s") is not None else None
        beat = hb.get("progress") if hb else None
        progress = {"done": beat["done"], "total": beat["total"]} if beat else None
        ranks.append({
            "rank": r,
            "heartbeat_mtime": mtime,
            "out": r in members.out,
            "host": (hb or join).get("host"),
            "pid": (hb or join).get("pid"),
            "alive": alive,
            "state": state,
            "iteration": hb.get("iteration") if hb else None,
            "phase": hb.get("phase") if hb else None,
            "progress": progress,
            "rate": beat.get("rate") if beat else None,
            "in_phase_s": in_phase,
            "heartbeat_age_s": age,
            "training": hb.get("training") if hb else None,
        })
    progress = fsio.read_record(layout.progress)
    last = progress["iteration"] if progress else 0
    if any(r["iteration"] for r in ranks):
        last = max(last, max(r["iteration"] or 0 for r in ranks))
    logs = events.read()
    times = timing.iteration_timing(logs)
    iterations = []
    for i in range(1, last + 1):
        s = summary.read(layout, i)
        if s is not None:
            iterations.append({**{k: s.get(k) for k in ("iteration", "tasks_per_rank", "tasks_done_per_rank", "tasks_taken_per_rank",
                                                         "trajectories", "evaluated", "metrics", "checkpoint", "complete",
                                                         "reward_errors", "prompts_too_long", "staleness", "is_ratio", "update",
                                                         "resample", "partial")},
                               "timing": times.get(i)})
    barrier = barrier_state(attempt, current.attempt, num_nodes, now, ranks, members.out) if not current.released else None
    gone = None if current.released else all_gone(ranks, now)
    return {
        "log_path": str(log_path),
        "attempt": current.attempt,
        "master": {"host": current.host, "pid": current.pid, "generation": current.generation, "released": current.released},
        "num_nodes": num_nodes,
        "rl_phase": start.get("rl_phase") or fp.get("rl_phase"),
        "max_iterations": fp.get("max_iterations"),
        "last_released": progress,
        "ranks": ranks,
        "failure": root_cause(attempt, num_nodes, members.out),
        "ranks_out": [{"rank": r, **entry} for r, entry in sorted(members.out.items())],
        "membership": members.events,
        "barrier": barrier,
        "gone": gone,
        "waiting_for": barrier["waiting_for"] if barrier else [],
        "eta": eta(timing.phase_durations(logs), ranks[0] if ranks else None, start.get("rl_phase") or fp.get("rl_phase")),
        "notes": (fsio.read_record(attempt.notes) or {}).get("notes", []),
        "iterations": iterations,
        "pipeline": pipeline(fp.get("max_staleness") or 0, ranks, iterations),
        "tracking": tracking(layout),
    }


def tracking(layout: RunLayout) -> dict | None:
    """Experiment tracking as the master last wrote it (tracking.backends): per backend
    ``{ok, iteration, where, error}``; None without tracking."""
    state = fsio.read_record(layout.tracking / "state.json")
    return {"run_name": state.get("run_name"), "backends": state.get("backends") or {}} if state else None


def pipeline(max_staleness: int, ranks: list[dict], iterations: list[dict]) -> dict | None:
    """rl.max_staleness >= 1: both halves at once. Where the rollout half is (the master's
    iteration and phase), which iteration trains in the background and on which ranks, and
    how stale that iteration's trajectories are (checkpoints behind the update)."""
    if not max_staleness:
        return None
    training = sorted({r["training"] for r in ranks if r.get("training") and r["alive"]})
    trained = training[0] if training else None
    stale = next((it.get("staleness") for it in iterations if it["iteration"] == trained), None)
    master = ranks[0] if ranks else {}
    return {
        "max_staleness": max_staleness,
        "iteration": master.get("iteration"),
        "phase": master.get("phase"),
        "training": trained,
        "training_ranks": [r["rank"] for r in ranks if r.get("training") == trained] if trained else [],
        "staleness": stale,
    }


def all_gone(ranks: list[dict], now: float | None) -> dict | None:
    """When no rank of an unfinished run is alive (all killed, or the last ones failed after
    the master died): since when (the newest heartbeat, on the file server's clock), and
    where each rank was last."""
    if not ranks or any(r["alive"] for r in ranks):
        return None
    stamps = [r["heartbeat_mtime"] for r in ranks if r["heartbeat_mtime"] is not None]
    since = max(stamps) if stamps else None
    return {
        "since": since,
        "since_s": round(max(0.0, now - since), 3) if since is not None and now is not None else None,
        "last": [{k: r[k] for k in ("rank", "host", "iteration", "phase", "state")} for r in ranks],
        "next": "re-run the same commands on every node to resume",
    }


def barrier_state(attempt, attempt_id: str, num_nodes: int, now: float | None, ranks: list[dict], out=()) -> dict | None:
    """The barrier ranks are waiting at: the latest one some rank arrived at and the master
    has not released; who has arrived, and whom it still waits for (not the ranks the run
    goes on without), since when."""
    released = fsio.read_record(attempt.release)
    last = (released["iteration"], released["phase"]) if released else (0, -1)
    arrivals: dict[int, tuple[tuple[int, int], float | None]] = {}
    fsio.refresh_dir(attempt.arrivals)
    for r in range(num_nodes):
        a = fsio.read_record(attempt.arrive(r))
        if a is not None and a.get("attempt") == attempt_id:
            arrivals[r] = ((a["iteration"], a["phase"]), _mtime(attempt.arrive(r)))
    pending = [key for key, _ in arrivals.values() if key > last]
    if not pending:
        return None
    key = max(pending)
    arrived = sorted(r for r, (k, _) in arrivals.items() if k == key)
    stamps = [m for r, (k, m) in arrivals.items() if k == key and m is not None]
    waited = round(max(0.0, now - min(stamps)), 3) if stamps and now is not None else None
    return {
        "iteration": key[0],
        "phase": key[1],
        "label": Phase(key[1]).label,
        "arrived": arrived,
        "waiting_for": [{"rank": r, "host": ranks[r]["host"], "at": ranks[r]["phase"], "state": ranks[r]["state"],
                         "waited_s": waited} for r in range(num_nodes) if r not in arrived and r not in out],
    }


def eta(durations: dict[tuple[int, int], float], master: dict | None, rl_phase: str | None) -> dict | None:
    """How long the master's current phase and the rest of its iteration should take,
    from the median of the same phases in earlier iterations (``durations``: see
    :func:`timing.phase_durations`). None without history."""
    if not master or not master.get("phase") or master.get("iteration") is None or master.get("in_phase_s") is None:
        return None
    if master["state"] in TERMINAL_STATES:
        return None
    current = Phase(int(str(master["phase"]).split(":")[0]))
    iteration = master["iteration"]
    typical: dict[int, float] = {}
    for phase in Phase:
        past = [d for (i, p), d in durations.items() if p == int(phase) and i < iteration] if phase >= current else []
        if past:
            typical[int(phase)] = statistics.median(past)
    if int(current) not in typical:
        return None
    remaining = max(0.0, typical[int(current)] - master["in_phase_s"])
    walks = RLPhase(rl_phase) if rl_phase else RLPhase.BOTH
    later = sum(d for p, d in typical.items() if p > int(current) and walks.includes(Phase(p)))
    return {
        "iteration": iteration,
        "phase": current.label,
        "typical_s": round(typical[int(current)], 3),
        "elapsed_s": master["in_phase_s"],
        "remaining_s": round(remaining, 3),
        "iteration_remaining_s": round(remaining + later, 3),
    }


def root_cause(attempt, num_nodes: int, out=()) -> dict | None:
    """The first observed failure of the attempt: the master's abort if it wrote one, else a
    rank's own failure record, else a rank's report of a peer it lost (not of a rank the run
    went on without: it does not end the attempt)."""
    abort = fsio.read_record(attempt.abort)
    if abort is not None:
        c = abort["culprit"]
        return {k: c.get(k) for k in ("rank", "host", "iteration", "phase", "kind", "error", "child")}
    records = [(r, fsio.read_record(attempt.failure(r))) for r in range(num_nodes) if r not in out]
    records = [(r, f) for r, f in records if f is not None]
    for r, f in records:
        if f.get("kind") in ROOT_CAUSE_KINDS:
            return {"rank": r, "host": f.get("host"), "iteration": f.get("iteration"), "phase": f.get("phase"),
                    "kind": f.get("kind"), "error": f.get("error"), "child": f.get("child")}
    for r, f in records:
        if f.get("culprit"):
            c = f["culprit"]
            return {k: c.get(k) for k in ("rank", "host", "iteration", "phase", "kind", "error", "child")}
    return None
