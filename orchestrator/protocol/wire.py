"""The names ranks exchange through files: heartbeat states and event names.

They are ``StrEnum``s: a file holds the plain value (the format is unchanged) and the code
that writes or reads one compares types, not strings spelled again in each module. Failure
kinds are ``errors.FailureKind`` (the exceptions carry them); the records themselves are
dataclasses serialized by ``orchestrator.records``.
"""

from __future__ import annotations

from enum import StrEnum


class HeartbeatState(StrEnum):
    """What a rank says it is doing, in its heartbeat."""

    JOINING = "joining"
    WORKING = "working"
    """Doing a phase's work."""
    WAITING = "waiting"
    """Arrived at a barrier."""
    HELD = "held"
    """Held by a test's fault injection."""
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


# States a rank writes as it leaves: it is gone, but not dead.
TERMINAL_STATES = frozenset({HeartbeatState.DONE, HeartbeatState.STOPPED, HeartbeatState.FAILED, HeartbeatState.INTERRUPTED})


class Event(StrEnum):
    """The ``event`` of a line in a rank's ``events.jsonl``."""

    PHASE = "phase"
    """The rank began a phase's work."""
    ARRIVE = "arrive"
    """It arrived at the phase's barrier (``work_s``: how long the work took)."""
    ALL_ARRIVED = "all_arrived"
    """Master: every rank arrived; the phase's decision runs now."""
    RELEASED = "released"
    """The barrier released it (``wait_s``: how long it waited)."""
    TIMING = "timing"
    """A part of a phase's work took ``seconds`` (``part``: e.g. ``train.steps``, ``engine.reload``)."""
    STEAL = "steal"
    """The rank took a chunk of another rank's first share (``split``, ``chunk``, ``tasks``, ``victim``)."""
    OUT = "out"
    """Master: the run goes on without rank ``who`` (coordination.elastic; ``reason``)."""
    REJOINED = "rejoined"
    """Master: rank ``who`` is back in the run from this iteration on."""
    ERROR = "error"
    END = "end"
    """The rank ended (``state``: its last heartbeat state)."""
