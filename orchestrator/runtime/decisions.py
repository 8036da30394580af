"""What a rank holds of the run's decisions besides its position, each taken from the
release that carries it rather than read back from files:

- the policy the run has published (``policy``): read from ``checkpoints/current.json`` once,
  when the rank enters an attempt, then told by every phase 11 release (``published``);
- the training plans released and not yet published (``training``): phase 9's decisions
  (``training``), which a resumed attempt gets from ``progress.json`` through its start record.

The master's decisions of phases 9 and 11 are in runtime/phases/prepare.py and publish.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.protocol import records
from orchestrator.checkpoints import store
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.schema import TrainingPlan

TRAINING = "training"
"""Phase 9's decision: the iteration's ``TrainingPlan``."""
PUBLISHED = "published"
"""Phase 11's decision: the checkpoint the run now serves, ``{"iteration": I, "path": ...}``."""


@dataclass(slots=True)
class Decisions:
    layout: RunLayout
    policy: store.Checkpoint
    training: dict[int, TrainingPlan] = field(default_factory=dict)

    @classmethod
    def entering(cls, layout: RunLayout, base: Path, training: tuple[TrainingPlan, ...]) -> "Decisions":
        """At an attempt's start: the published policy (one read of the current pointer) and
        the plans the start record carries."""
        return cls(layout, store.current(layout, base), {p.iteration: p for p in training})

    def in_force(self, decision: dict) -> tuple[TrainingPlan, ...]:
        """The training plans released and not yet published once ``decision`` is."""
        plans = dict(self.training)
        if TRAINING in decision:
            plan = records.from_dict(decision[TRAINING], TrainingPlan)
            plans[plan.iteration] = plan
        if PUBLISHED in decision:
            plans.pop(decision[PUBLISHED]["iteration"], None)
        return tuple(plans[i] for i in sorted(plans))

    def released(self, decision: dict) -> None:
        """Take what a barrier's ``decision`` says."""
        self.training = {p.iteration: p for p in self.in_force(decision)}
        if PUBLISHED in decision:
            published = decision[PUBLISHED]
            self.policy = store.Checkpoint(self.layout.root / published["path"], published["iteration"])
