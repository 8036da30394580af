"""The report's per-iteration figures from the run's own records, not its event logs: the
iterations' ``summary.json``, ``metrics.jsonl`` (eval) and the train aggregates (the mean
train reward, read as a stream), joined into one row per iteration with the time the event
logs give it.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.data import shards, summary
from orchestrator.ops.event_fold import MASTER, is_number
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout


def _iteration_numbers(layout: RunLayout) -> list[int]:
    fsio.refresh_dir(layout.iterations)  # NFS: see iterations created since this client last looked
    try:
        names = [p.name for p in layout.iterations.iterdir() if p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if n.isdigit())


def eval_curve(layout: RunLayout) -> list[dict]:
    """The lines of ``metrics.jsonl`` (one per evaluated iteration), sorted by iteration."""
    return summary.read_metrics(layout)


def _record_rewards(record: dict) -> list[float]:
    """The rewards of one trajectory record: an RL record's samples, or a rehearsal record's
    single ``reward``."""
    samples = record.get("samples")
    if isinstance(samples, list):
        return [float(s["reward"]) for s in samples if isinstance(s, dict) and is_number(s.get("reward"))]
    if is_number(record.get("reward")):
        return [float(record["reward"])]
    return []


def train_reward(aggregate: Path) -> dict | None:
    """Mean reward over every sample of a sealed train aggregate, read as a stream; None
    when the aggregate is not sealed (absent, or still being written)."""
    if shards.sealed(aggregate) is None:
        return None
    records, n, total = 0, 0, 0.0
    for _, _, record in shards.iter_valid_lines(aggregate):
        records += 1
        for r in _record_rewards(record):
            n += 1
            total += r
    return {"mean_reward": total / n if n else None, "records": records, "samples": n}


def train_rewards(layout: RunLayout) -> list[dict]:
    """``{iteration, mean_reward, records, samples}`` for each iteration with a sealed train
    aggregate, sorted by iteration."""
    out = []
    for i in _iteration_numbers(layout):
        r = train_reward(layout.iteration(i).aggregate("train"))
        if r is not None:
            out.append({"iteration": i, **r})
    return out


def iteration_rows(layout: RunLayout, evals: list[dict], trains: list[dict], segments: list[dict],
                   times: dict[int, dict]) -> list[dict]:
    """One row per iteration seen anywhere (summary, metrics, aggregate or events): the
    table of the HTML page. ``master_s`` is the time rank 0 spent in the iteration's phases
    (work, wait and decide, over all attempts); ``timing`` the iteration's entry of ``times``
    (:func:`timing.iteration_timing`), or None."""
    by_eval = {e["iteration"]: e for e in evals}
    by_train = {t["iteration"]: t for t in trains}
    master_s: dict[int, float] = {}
    for s in segments:
        if s["rank"] == MASTER and isinstance(s["iteration"], int):
            master_s[s["iteration"]] = master_s.get(s["iteration"], 0.0) + s["seconds"]
    summaries = {i: summary.read(layout, i) for i in _iteration_numbers(layout)}
    numbers = sorted({i for i, s in summaries.items() if s is not None} | set(by_eval) | set(by_train) | set(master_s))
    rows = []
    for i in numbers:
        s = summaries.get(i) or {}
        e = by_eval.get(i, {})
        ratio = s.get("is_ratio") or {}
        rows.append({
            "iteration": i,
            "tasks_per_rank": s.get("tasks_per_rank"),
            "tasks_done_per_rank": s.get("tasks_done_per_rank"),
            "tasks_taken_per_rank": s.get("tasks_taken_per_rank"),
            "trajectories": s.get("trajectories"),
            "train_mean_reward": by_train.get(i, {}).get("mean_reward"),
            "evaluated": bool(s.get("evaluated")) or i in by_eval,
            "eval_accuracy": e.get("accuracy"),
            "eval_mean_reward": e.get("mean_reward"),
            "eval_pass_at_k": e.get("pass_at_k"),
            "checkpoint": s.get("checkpoint"),
            "staleness": s.get("staleness"),
            "is_ratio_mean": ratio.get("mean"),
            "is_ratio_max": ratio.get("max"),
            "is_capped_fraction": ratio.get("capped_fraction"),
            "complete": bool(s.get("complete")),
            "master_s": master_s.get(i),
            "timing": times.get(i),
        })
    return rows
