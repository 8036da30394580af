"""`orchestrator recover`: what survived a broken run, and the two repairs it may need.

- Inventory: per iteration, every rank's shard (sealed, partial with its complete records,
  absent), the aggregates (full or partial), the checkpoint; and the sync state of the last
  attempt (lease, start, abort, who is alive).
- Clearing the sync state: the lease of a master that is gone is moved aside (under
  ``control/recovered/<stamp>/``) and replaced by a released lease of the same generation,
  so the next master starts at once instead of watching a dead heartbeat for
  ``coordination.node_timeout_s``. Nothing is deleted.
- Salvage: the shards of one iteration merged into an aggregate marked partial, with counts
  per rank (``shards.salvage``). Training refuses it unless ``rl.train_on_partial=true``.

Both repairs are dry runs unless applied, and refuse while any rank of the run is alive.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.protocol import records
from orchestrator.data import claims, resample, shards
from orchestrator.errors import BadInput
from orchestrator.ops import status
from orchestrator.protocol import fsio
from orchestrator.protocol import lease as lease_mod
from orchestrator.protocol.layout import RunLayout

SPLITS = ("train", "eval")


def _shard_state(shard: Path) -> dict:
    if shards.sealed(shard) is not None:
        m = shards.read_manifest(shard)
        return {"state": "sealed", "records": m.count}
    if shard.exists():
        return {"state": "partial", "records": sum(1 for _ in shards.iter_valid_lines(shard))}
    return {"state": "absent", "records": 0}


def _iterations(layout: RunLayout) -> list[int]:
    fsio.refresh_dir(layout.iterations)
    try:
        return sorted(int(p.name) for p in layout.iterations.iterdir() if p.name.isdigit())
    except FileNotFoundError:
        return []


def iteration_inventory(layout: RunLayout, iteration: int) -> dict:
    it = layout.iteration(iteration)
    plan = fsio.read_record(it.plan) or {}
    out: dict = {"iteration": iteration, "planned": bool(plan), "splits": {}}
    for split in SPLITS:
        per_rank = (plan.get(split) or {}).get("per_rank") or []
        if not per_rank or not (plan.get(split) or {}).get("enabled", True):
            continue
        ranks = [{"rank": r, "assigned": per_rank[r] if r < len(per_rank) else 0, **_shard_state(claims.shard_of(it, split, r))}
                 for r in _rollout_ranks(it, split, plan[split])]
        agg = shards.sealed(it.aggregate(split))
        out["splits"][split] = {
            "planned": sum(per_rank),
            "ranks": ranks,
            "aggregate": None if agg is None else {"records": agg.count, "partial": bool(agg.extra.get("partial")),
                                                   "per_source": agg.extra.get("per_source")},
        }
    ckpt = layout.checkpoint(iteration)
    out["checkpoint"] = str(ckpt.relative_to(layout.root)) if ckpt.is_dir() else None
    return out


def sync_state(layout: RunLayout) -> dict:
    try:
        current = lease_mod.read_lease(layout, settle_s=1.0)
        corrupt = False
    except BadInput:
        current, corrupt = None, True
    out: dict = {"lease": records.to_dict(current) if current else None, "lease_corrupt": corrupt,
                 "progress": fsio.read_record(layout.progress), "attempt": None}
    if current is not None:
        attempt = layout.attempt(current.attempt)
        start = fsio.read_record(attempt.start)
        abort = fsio.read_record(attempt.abort)
        out["attempt"] = {
            "id": current.attempt,
            "started": start is not None,
            "num_nodes": (start or {}).get("num_nodes"),
            "ended_by": abort["culprit"] if abort else None,
        }
    return out


def inventory(log_path: Path) -> dict:
    layout = RunLayout(log_path)
    if not layout.control.is_dir():
        raise BadInput(f"no run found under {log_path} (no control/ directory): is --log-path right?")
    return {
        "log_path": str(log_path),
        "sync": sync_state(layout),
        "alive": alive_ranks(log_path),
        "iterations": [iteration_inventory(layout, i) for i in _iterations(layout)],
    }


def alive_ranks(log_path: Path) -> list[dict]:
    """Ranks of the current attempt whose heartbeat is fresh (see `status`)."""
    try:
        snap = status.snapshot(log_path)
    except BadInput:
        return []
    return [{"rank": r["rank"], "host": r["host"], "pid": r["pid"], "heartbeat_age_s": r["heartbeat_age_s"]}
            for r in snap["ranks"] if r["alive"]]


def refuse_if_alive(log_path: Path, force: bool) -> None:
    alive = alive_ranks(log_path)
    if alive and not force:
        names = ", ".join(f"rank {a['rank']} on {a['host']} (pid {a['pid']}, heartbeat {a['heartbeat_age_s']} s ago)" for a in alive)
        raise BadInput(
            f"the run is alive: {names}. Stop it first (orchestrator stop --log-path {log_path}, or Ctrl+C on each node), "
            f"or wait until their heartbeats are older than the node timeout; --force acts anyway"
        )


def _aside(layout: RunLayout) -> Path:
    return layout.recovered(time.strftime("%Y%m%dT%H%M%S"))


def clear_sync_state(log_path: Path, apply: bool) -> list[str]:
    """What clearing does (done when ``apply``): the lease moved aside, a released one in its place."""
    layout = RunLayout(log_path)
    state = sync_state(layout)
    current = state["lease"]
    if current is None and not state["lease_corrupt"]:
        return []
    if current is not None and current.get("released"):
        return []
    aside = _aside(layout)
    generation = current["generation"] if current else _highest_claim(layout)
    actions = [f"move {layout.lease} to {aside / 'lease.json'}",
               f"write a released lease of generation {generation}, so the next master starts at once"]
    if apply:
        aside.mkdir(parents=True, exist_ok=True)
        os.replace(layout.lease, aside / "lease.json")
        fsio.fsync_dir(layout.control)
        released = dict(current) if current else {"generation": generation, "attempt": "recovered", "host": "?", "pid": 0,
                                                    "pid_start": None}
        fsio.write_record(layout.lease, {**released, "released": True})
    return actions


def _highest_claim(layout: RunLayout) -> int:
    directory = layout.claim(0).parent
    fsio.refresh_dir(directory)
    try:
        return max((int(p.name.removeprefix("gen-")) for p in directory.iterdir() if p.name.startswith("gen-")), default=0)
    except FileNotFoundError:
        return 0


def _rollout_ranks(it, split: str, split_plan: dict) -> list[int]:
    """The ranks whose shards may hold records of the split: those with a first share, and
    every rank that claimed a chunk (work stealing, or a run resumed on more nodes)."""
    owners = claims.owners(it, split, claims.all_chunks(it, split, split_plan))
    return sorted({r for r, n in enumerate(split_plan.get("per_rank") or []) if n > 0} | {o for o in owners if o is not None})


def salvage(log_path: Path, iteration: int, apply: bool, split: str = "train") -> dict:
    """The partial aggregate ``--salvage`` would write (and writes, when ``apply``)."""
    layout = RunLayout(log_path)
    it = layout.iteration(iteration)
    plan = fsio.read_record(it.plan)
    if plan is None:
        raise BadInput(f"iteration {iteration} has no plan under {log_path}: it never started, nothing to salvage")
    per_rank = (plan.get(split) or {}).get("per_rank") or []
    if not per_rank or sum(per_rank) == 0:
        raise BadInput(f"iteration {iteration} planned no {split} tasks: nothing to salvage")
    existing = shards.sealed(it.aggregate(split))
    if existing is not None and not existing.extra.get("partial"):
        raise BadInput(f"iteration {iteration} already has a full {split} aggregate ({existing.count} records): nothing to salvage")
    # With rl.filter_groups, the resample rounds the rollout reached too (data/resample.py).
    parts = [p for p in resample.planned(plan) if p == split or it.shard(p, 0).parent.is_dir()] if split == "train" else [split]
    sources = [(f"rank {r}" if p == split else f"rank {r} ({p})", claims.shard_of(it, p, r))
               for p in parts for r in _rollout_ranks(it, p, plan[p])]
    per_rank = [n for p in parts for n in plan[p]["per_rank"]]
    preview = {label: _shard_state(shard) for label, shard in sources}
    result = {"iteration": iteration, "split": split, "planned": sum(per_rank),
              "per_rank": {label: s["records"] for label, s in preview.items()},
              "state": {label: s["state"] for label, s in preview.items()},
              "records": sum(s["records"] for s in preview.values()), "written": None}
    if apply:
        # A group a partial rollout stopped (rollout.partial) is not trained: the salvage keeps finished ones.
        m = shards.salvage(sources, it.aggregate(split), lambda _label, record: not record.get("unfinished"), split=split,
                           iteration=iteration, planned=sum(per_rank), salvaged_at=time.time())
        result.update(records=m.count, per_rank=m.extra["per_source"], trajectories=m.extra["trajectories"],
                      written=str(it.aggregate(split).relative_to(layout.root)))
    return result
