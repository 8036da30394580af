"""The monitor's verdicts, pure functions of what a rank read: who ended the attempt and why
(:func:`master_verdict`, :func:`worker_verdict`), and how long a death takes to be named
(:func:`verdict_bound_s`). The monitor thread that reads the files, calls them and acts is
coordination/monitor.py."""

from __future__ import annotations

from orchestrator.errors import ROOT_CAUSE_KINDS, Culprit, FailureKind
from orchestrator.protocol import records
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.membership import ranks_text


def poll_interval_s(heartbeat_interval_s: float) -> float:
    """How often the master's monitor looks for a verdict (heartbeats: once an interval)."""
    return min(0.25, heartbeat_interval_s / 2)


def verdict_bound_s(node_timeout_s: float, heartbeat_interval_s: float, watch_interval_s: float, fan_in: bool = False) -> float:
    """The longest, from a rank's death, until every other rank's monitor knows of it.

    A worker: its last beat was written at most when it died; the master, reading heartbeats
    once an interval, sees that beat up to an interval later and calls it dead
    ``node_timeout_s`` after that, at its next poll; a worker learns it at its next read of the
    master's heartbeat (``watch_interval_s``). The master: a worker sees its last beat up to
    one watch interval late and judges at a read a watch interval apart. A rank that sees the
    death first (a trainer's lost connection) waits this long for the verdict naming the rank
    that died. ``fan_in``: a worker's beat reaches the master through its group's leader, which
    reads it up to an interval late, and the master reads the group files twice an interval."""
    relay = heartbeat_interval_s / 2 if fan_in else 0.0
    return node_timeout_s + max(heartbeat_interval_s + relay + poll_interval_s(heartbeat_interval_s), watch_interval_s) + watch_interval_s


def culprit_from_failure(rank: int, failure: dict) -> Culprit:
    return Culprit(
        rank=rank,
        host=failure.get("host", "?"),
        iteration=failure.get("iteration"),
        phase=failure.get("phase"),
        kind=failure.get("kind", "error"),
        error=failure.get("error", "unknown error"),
    )


def culprit_dead(rank: int, tracker: LivenessTracker, now: float, hosts: dict[int, str]) -> Culprit:
    last = tracker.last(rank) or {}
    return Culprit(
        rank=rank,
        host=last.get("host") or hosts.get(rank, "?"),
        iteration=last.get("iteration"),
        phase=last.get("phase"),
        kind=FailureKind.DEAD,
        error=f"no heartbeat for {tracker.silent_for(rank, now):.1f} s (node timeout {tracker.timeout_s:g} s)",
    )


def master_verdict(
    failures: dict[int, dict], tracker: LivenessTracker, now: float, hosts: dict[int, str]
) -> Culprit | None:
    """The root cause that ends the attempt, if any: a rank's own failure record first
    (it knows why); then workers that gave up on the master (it was frozen or paused past
    the node timeout: they judged it dead and left, so nothing is left to wait for); else
    the first rank whose heartbeat stopped."""
    for rank in sorted(failures):
        f = failures[rank]
        if f.get("kind") in ROOT_CAUSE_KINDS:
            return culprit_from_failure(rank, f)
    left = abandoned_by(failures)
    if left:
        seen = failures[left[0]]["culprit"]
        return Culprit(0, seen.get("host") or hosts.get(0, "?"), seen.get("iteration"), seen.get("phase"), FailureKind.DEAD,
                       f"its heartbeat stood still past the node timeout (the master was frozen or paused) and rank(s) "
                       f"{ranks_text(left)} gave up on it")
    dead = tracker.dead(now)
    if dead:
        return culprit_dead(dead[0], tracker, now, hosts)
    return None


def abandoned_by(failures: dict[int, dict]) -> list[int]:
    """The workers whose failure record says they left because the master looked dead."""
    def gave_up(f: dict) -> bool:
        culprit = f.get("culprit") or {}
        return f.get("kind") == FailureKind.PEER and culprit.get("rank") == 0 and culprit.get("kind") == FailureKind.DEAD
    return sorted(r for r, f in failures.items() if r != 0 and gave_up(f))


def worker_verdict(abort: dict | None, tracker: LivenessTracker, now: float, hosts: dict[int, str]) -> Culprit | None:
    if abort is not None:
        return records.from_dict(abort["culprit"], Culprit)
    if tracker.dead(now):
        return culprit_dead(0, tracker, now, hosts)
    return None
