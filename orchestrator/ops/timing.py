"""Where each iteration's time went, from the ranks' event logs as :mod:`event_fold` folds
them: ``iterations[].timing`` of `status` and of `report`, and the phase durations the ETA
is estimated from.

Two sources, both in ``attempts/<A>/events/r<R>.jsonl``:

- the master's ``phase`` and ``released`` events: seconds the master spent in each
  (iteration, phase), work and barrier together, on its own monotonic clock;
- every rank's ``timing`` events (``Coordinator.timing``): how long a part of a phase's
  work took (``train.steps``, ``engine.reload``, ...), per rank, train worker or engine.
"""

from __future__ import annotations

from orchestrator.ops.event_fold import MASTER, RankLog, phase_label

# The parts in the order they are listed: training's in the order they happen, then the
# engines'; a part not listed here sorts after them, by name.
PART_ORDER = (
    "train.startup", "train.load", "train.replay", "train.prepare", "train.steps", "train.checkpoint", "train.total",
    "engine.rebuild", "engine.start", "engine.restart", "engine.reload", "engine.release",
)


def part_sort_key(part: str) -> tuple[int, str]:
    return (PART_ORDER.index(part) if part in PART_ORDER else len(PART_ORDER), part)


def phase_durations(logs: list[RankLog]) -> dict[tuple[int, int], float]:
    """Seconds the master spent in each (iteration, phase), work and barrier together, over
    every attempt (``logs``, oldest attempt first: a later attempt wins)."""
    durations: dict[tuple[int, int], float] = {}
    for log in logs:
        if log.rank == MASTER:
            durations.update(log.durations)
    return durations


def iteration_timing(logs: list[RankLog]) -> dict[int, dict]:
    """Per iteration: ``{"phases": {label: s}, "total_s": s, "parts": {part: s}}``, and
    ``"bytes": {"written": n, "read": n, ...}`` when the run recorded them: the checkpoint the
    trainers wrote (``written_weights`` what the engines read of it, ``written_deltas`` of
    those the deltas, ``written_state`` the training state's: optimizer, fp32 master), and what every engine read to serve it (a
    reload, or a start's model; ``read_per_node``: by rank, as ``{"R": n}``).

    ``phases`` are the master's phase durations, ``total_s`` their sum. ``parts[p]`` is the
    slowest actor's time in part ``p`` (ranks, train workers and engines run in parallel):
    an actor (rank, worker, engine) adds up its times in the iteration's phases, and for
    the same phase a later attempt's figure replaces an earlier one's.
    """
    by_key: dict[tuple[int, int, str, object, object, int], float] = {}
    moved: dict[tuple[int, int, str, object, object, int], tuple[int, dict[str, int]]] = {}
    for log in logs:
        for (iteration, phase, part, worker, engine), seconds in log.parts.items():
            by_key[(iteration, phase, part, worker, engine, log.rank)] = seconds
        for key, n in log.part_bytes.items():  # a later attempt's replaces an earlier one's
            moved[(*key, log.rank)] = (n, log.part_byte_kinds.get(key, {}))
    bytes_: dict[int, dict] = {}
    for (iteration, _, part, _, _, rank), (n, kinds) in moved.items():
        totals = bytes_.setdefault(iteration, {"written": 0, "read": 0, "written_weights": 0, "written_deltas": 0, "written_state": 0,
                                               "read_per_node": {}})
        if part.startswith("train."):
            totals["written"] += n
            totals["written_state"] += kinds.get("state", 0)
            totals["written_deltas"] += kinds.get("delta", 0)
            totals["written_weights"] += n - kinds.get("state", 0)
        else:
            totals["read"] += n
            totals["read_per_node"][str(rank)] = totals["read_per_node"].get(str(rank), 0) + n
    per_actor: dict[tuple[int, str, object, object, int], float] = {}
    for (iteration, _, part, worker, engine, rank), seconds in by_key.items():
        actor = (iteration, part, worker, engine, rank)
        per_actor[actor] = per_actor.get(actor, 0.0) + seconds
    parts: dict[int, dict[str, float]] = {}
    for (iteration, part, *_), seconds in per_actor.items():
        slowest = parts.setdefault(iteration, {})
        slowest[part] = max(slowest.get(part, 0.0), seconds)
    phases: dict[int, dict[int, float]] = {}
    for (iteration, phase), seconds in phase_durations(logs).items():
        if isinstance(iteration, int) and isinstance(phase, int):
            phases.setdefault(iteration, {})[phase] = seconds
    out = {}
    for iteration in sorted(set(phases) | set(parts) | set(bytes_)):
        mine = phases.get(iteration, {})
        out[iteration] = {
            "phases": {phase_label(p): round(mine[p], 3) for p in sorted(mine)},
            "total_s": round(sum(mine.values()), 3),
            "parts": {p: round(s, 3) for p, s in sorted(parts.get(iteration, {}).items(), key=lambda kv: part_sort_key(kv[0]))},
        }
        if iteration in bytes_:
            out[iteration]["bytes"] = bytes_[iteration]
    return out
