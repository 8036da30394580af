"""The exceptions every layer shares, and the exit code each one ends a rank with."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_PEER_FAILED = 3
EXIT_INTERRUPTED = 130


class OrchestratorError(Exception):
    """Base class; ``exit_code`` is what the rank exits with."""

    exit_code = EXIT_ERROR


class BadInput(OrchestratorError):
    """The user's input or the run's state refuses this command (nothing was written)."""

    exit_code = EXIT_BAD_INPUT


class ServiceError(OrchestratorError):
    """A child's service (an inference engine's server) could not serve a request: it answered
    with an error, or not at all. When the rank was stopping, a consequence of its stop."""


class ChildFailed(OrchestratorError):
    """A child process of this rank (a train worker, an engine) failed. ``child`` is the
    error record it wrote itself (``protocol/child_error.py``), or None when it died without
    one; the message then carries its log's tail."""

    def __init__(self, message: str, child: dict | None = None):
        super().__init__(message)
        self.child = child


class ConfigError(ValueError):
    """Bad input or configuration: exit code 2, nothing written."""


class FailureKind(StrEnum):
    """What ended a rank, in its failure record and in an attempt's culprit."""

    DEAD = "dead"
    """Its heartbeat stopped (judged by another rank)."""
    ERROR = "error"
    INTERRUPTED = "interrupted"
    """SIGINT or SIGTERM."""
    DEADLINE = "deadline"
    JOIN = "join"
    """It never joined the attempt."""
    PEER = "peer"
    """It stopped because another rank failed: a report of a root cause, never one itself."""


# The kinds a rank records as the cause of an attempt's end ("dead" is judged by others, "peer" only reports).
ROOT_CAUSE_KINDS = frozenset({FailureKind.ERROR, FailureKind.INTERRUPTED, FailureKind.DEADLINE, FailureKind.JOIN})


@dataclass(frozen=True, slots=True)
class Culprit:
    """Who caused an attempt to end, where it was, and what happened."""

    rank: int
    host: str
    iteration: int | None
    phase: str | None
    kind: FailureKind
    error: str
    child: dict | None = None
    """The error record of the child process (trainer, engine) whose failure this was, if any."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind(self.kind))  # a kind no reader knows fails here, not later

    def describe(self) -> str:
        where = f"rank {self.rank} on host {self.host}"
        at = f"iteration {self.iteration}, phase {self.phase}" if self.iteration is not None else "start-up"
        if self.kind is FailureKind.DEAD:
            return f"{where} died (heartbeat stopped) at {at}: {self.error}"
        if self.kind is FailureKind.INTERRUPTED:
            return f"{where} was stopped by the user ({self.error}) at {at}"
        if self.kind is FailureKind.DEADLINE:
            return f"{where} hit a deadline at {at}: {self.error}"
        if self.kind is FailureKind.JOIN:
            return f"{where} did not join: {self.error}"
        return f"{where} failed at {at}: {self.error}"


class PeerFailed(OrchestratorError):
    """Another rank failed, died or was stopped; this rank stops too (exit 3)."""

    exit_code = EXIT_PEER_FAILED

    def __init__(self, culprit: Culprit):
        super().__init__(culprit.describe())
        self.culprit = culprit


class MarkedOut(OrchestratorError):
    """With coordination.elastic, the master went on without this rank (it was silent past the
    node timeout): it stops its work and asks to rejoin at the next iteration's start."""

    exit_code = EXIT_PEER_FAILED


class Retrain(OrchestratorError):
    """With coordination.elastic, a rank was lost while the group trained: this rank stops its
    trainers and trains the step again with the ranks left (never an exit: the runner redoes
    the phase)."""


class DeadlineExceeded(OrchestratorError):
    """A wait ran past its deadline."""


class Interrupted(OrchestratorError):
    """SIGINT or SIGTERM reached this rank (exit 130)."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} received")
        self.signal_name = signal_name


class RunFinished(OrchestratorError):
    """The run has nothing left to walk: a worker that wakes or starts after the others
    finished ends at once (exit 0) instead of waiting for a master that will not come."""

    exit_code = EXIT_OK


class StopRequested(OrchestratorError):
    """`orchestrator stop` asked the run to end at this phase boundary (exit 0)."""

    exit_code = EXIT_OK
