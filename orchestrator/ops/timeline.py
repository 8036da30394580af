"""The run's timeline for `report`: every rank's segments, steals and membership changes over
every attempt, placed relative to the run's first event, and the barrier waits they add up to.

Positions are wall times (``t``) relative to the run's first event: ranks on different hosts
are placed by their own clocks, so a skew between hosts shifts their rows (durations, from
:mod:`event_fold`, are unaffected).
"""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.ops.event_fold import RankLog, phase_label


def timeline(logs: list[RankLog]) -> dict:
    """Every rank's segments over every attempt (``logs``: :meth:`EventReader.read` with
    ``timeline=True``), with times relative to the run's first event.

    Returns ``{origin_t, attempts: [{attempt, start_s, end_s, ranks}], iterations: [...],
    segments: [...], steals: [...], membership: [...]}``; each segment is ``{attempt, rank,
    kind, iteration, phase, label, start_s, end_s, seconds, complete}``, ordered by attempt,
    rank and time; ``iterations`` are the iterations' starts (:func:`iteration_starts`);
    each steal is ``{attempt, rank, victim, split, chunk, tasks, iteration, at_s}`` (work
    stealing); each membership change ``{attempt, event, rank, iteration, at_s}`` (``out`` or
    ``rejoined``, coordination.elastic), as the master recorded it.
    """
    placed = [log for log in logs if log.first_t is not None]
    if not placed:
        return {"origin_t": None, "attempts": [], "iterations": [], "segments": [], "steals": [], "membership": []}
    origin = min(log.first_t for log in placed)
    by_attempt: dict[str, list[RankLog]] = {}
    for log in logs:
        by_attempt.setdefault(log.attempt, []).append(log)
    attempts = []
    for a, mine in by_attempt.items():
        timed = [log for log in mine if log.first_t is not None]
        if timed:
            attempts.append({"attempt": a, "start_s": min(log.first_t for log in timed) - origin,
                             "end_s": max(log.last_t for log in timed) - origin, "ranks": sorted(log.rank for log in mine)})
    segments, steals, membership = [], [], []
    for log in placed:
        steals += [_at(s, origin, attempt=log.attempt, rank=log.rank) for s in log.steals]
        membership += [_at(m, origin, attempt=log.attempt) for m in log.membership]
        segments += [{"attempt": log.attempt, "rank": log.rank, "kind": s["kind"], "iteration": s["iteration"],
                      "phase": s["phase"], "label": phase_label(s["phase"]), "start_s": s["t_start"] - origin,
                      "end_s": s["t_end"] - origin, "seconds": s["seconds"], "complete": s["complete"]}
                     for s in log.segments()]
    return {"origin_t": origin, "attempts": attempts, "iterations": iteration_starts(segments), "segments": segments,
            "steals": steals, "membership": membership}


def iteration_starts(segments: Iterable[dict]) -> list[dict]:
    """Where each iteration starts on the timeline: ``{attempt, iteration, start_s}``, the
    earliest segment of the iteration over every rank of the attempt, in time order. An
    iteration that a later attempt ran again (after a failure) starts once per attempt."""
    first: dict[tuple[str, int], float] = {}
    for s in segments:
        if isinstance(s["iteration"], int):
            key = (s["attempt"], s["iteration"])
            first[key] = min(first.get(key, s["start_s"]), s["start_s"])
    starts = [{"attempt": a, "iteration": i, "start_s": t} for (a, i), t in first.items()]
    return sorted(starts, key=lambda x: (x["start_s"], x["iteration"]))


def _at(item: dict, origin: float, **where) -> dict:
    """A steal or membership change of a log, placed at ``at_s`` on the run's timeline."""
    return {**where, **{k: v for k, v in item.items() if k != "t"}, "at_s": item["t"] - origin}


def barrier_waits(segments: Iterable[dict]) -> list[dict]:
    """Barrier wait by (phase, rank) over all iterations and attempts: ``{phase, label, rank,
    count, total_s, mean_s, max_s}``, sorted by phase then rank. Only ``wait`` segments count
    (a master's decision time is not waiting)."""
    acc: dict[tuple[int, int], list[float]] = {}
    for s in segments:
        if s["kind"] == "wait" and isinstance(s["phase"], int):
            acc.setdefault((s["phase"], s["rank"]), []).append(s["seconds"])
    return [
        {"phase": p, "label": phase_label(p), "rank": r, "count": len(v), "total_s": sum(v), "mean_s": sum(v) / len(v), "max_s": max(v)}
        for (p, r), v in sorted(acc.items())
    ]
