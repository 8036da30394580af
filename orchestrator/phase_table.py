"""The 14 phases of one iteration: an enum and the one table of their properties.

The runner is generic; it reads this table to know who works in a phase, what barrier
closes it, which ``--rl-phase`` includes it and how long it may take. The work itself is
in ``runtime/phases/`` (one module per phase).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.IntEnum):
    SYNC_START = 0
    ROLLOUT = 1
    ROLLOUT_DONE = 2
    SHARDS_SEALED = 3
    AGGREGATE = 4
    EVAL_DECIDE = 5
    EVAL = 6
    ENGINE_STOP = 7
    PREPARE = 8
    TRAIN_CONFIG = 9
    TRAIN = 10
    PUBLISH = 11
    ENGINE_RESTART = 12
    SYNC_END = 13

    @property
    def label(self) -> str:
        """How files, logs and ``status`` name the phase (``10:train``); in memory it is a ``Phase``."""
        return f"{int(self)}:{self.name.lower()}"

    @classmethod
    def from_label(cls, label: str | None) -> "Phase | None":
        """The phase a record's label names (None stays None)."""
        return None if label is None else cls(int(label.split(":", 1)[0]))

    @property
    def spec(self) -> "PhaseSpec":
        return PHASE_TABLE[self]


class Actor(enum.Enum):
    """Who does the phase's work (everyone still takes part in its barrier)."""

    ALL = "all"
    MASTER = "master"

    def acts(self, is_master: bool) -> bool:
        return self is Actor.ALL or is_master


class Barrier(enum.Enum):
    """How a phase ends.

    ``ALL``: every rank announces arrival in its own file; the master reads the N known
    names, then publishes one release file (carrying the phase's decision) that all poll.
    ``NONE``: ranks go straight on; the next phase's barrier covers this one.
    """

    ALL = "all"
    NONE = "none"


class RLPhase(enum.Enum):
    ROLLOUT = "rollout"
    UPDATE = "update"
    BOTH = "both"

    def includes(self, phase: Phase) -> bool:
        if self is RLPhase.BOTH:
            return True
        return (phase <= Phase.EVAL) == (self is RLPhase.ROLLOUT)

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(p for p in Phase if self.includes(p))


@dataclass(frozen=True, slots=True)
class PhaseSpec:
    actor: Actor
    barrier: Barrier
    deadline_s: float
    summary: str
    needs_engine: bool = False


_HOUR = 3600.0

PHASE_TABLE: dict[Phase, PhaseSpec] = {
    Phase.SYNC_START: PhaseSpec(Actor.ALL, Barrier.ALL, _HOUR, "sync all nodes; master publishes the iteration plan"),
    Phase.ROLLOUT: PhaseSpec(Actor.ALL, Barrier.NONE, 8 * _HOUR, "train rollout on this rank's share", needs_engine=True),
    Phase.ROLLOUT_DONE: PhaseSpec(Actor.ALL, Barrier.ALL, _HOUR, "seal the rollout shard with its manifest"),
    Phase.SHARDS_SEALED: PhaseSpec(Actor.MASTER, Barrier.ALL, _HOUR, "master verifies every shard against its manifest"),
    Phase.AGGREGATE: PhaseSpec(Actor.MASTER, Barrier.ALL, 2 * _HOUR, "master merges the shards into the iteration's aggregate"),
    Phase.EVAL_DECIDE: PhaseSpec(Actor.MASTER, Barrier.ALL, _HOUR, "master decides whether eval is due"),
    Phase.EVAL: PhaseSpec(Actor.ALL, Barrier.ALL, 8 * _HOUR, "eval on this rank's share if due; master aggregates", needs_engine=True),
    Phase.ENGINE_STOP: PhaseSpec(Actor.ALL, Barrier.ALL, _HOUR, "stop the inference engine"),
    Phase.PREPARE: PhaseSpec(Actor.MASTER, Barrier.NONE, 2 * _HOUR, "master prepares the training data"),
    Phase.TRAIN_CONFIG: PhaseSpec(Actor.MASTER, Barrier.ALL, _HOUR, "master publishes the training config"),
    Phase.TRAIN: PhaseSpec(Actor.ALL, Barrier.ALL, 24 * _HOUR, "multi-node training"),
    Phase.PUBLISH: PhaseSpec(Actor.MASTER, Barrier.ALL, 2 * _HOUR, "master publishes the new checkpoint"),
    Phase.ENGINE_RESTART: PhaseSpec(Actor.ALL, Barrier.ALL, _HOUR, "restart the engine on the new checkpoint"),
    Phase.SYNC_END: PhaseSpec(Actor.MASTER, Barrier.ALL, _HOUR, "final sync; master removes checkpoints retention does not keep"),
}

assert set(PHASE_TABLE) == set(Phase), "every phase needs a row"


def eval_due(iteration: int, eval_interval: int) -> bool:
    """Evaluation runs on iterations 1, 1+N, 1+2N, ...."""
    return (iteration - 1) % eval_interval == 0
