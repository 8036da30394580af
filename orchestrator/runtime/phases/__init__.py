"""The work of each phase, one module per phase group, and the table the runner reads.

``WORK[phase](ctx)`` runs on the ranks the phase table says act; it may return a payload
that travels in the rank's arrival file. ``DECIDE[phase](ctx, arrivals)`` runs on the
master once every rank has arrived; what it returns is released to all ranks.
"""

from __future__ import annotations

from typing import Callable

from orchestrator.phase_table import Phase
from orchestrator.runtime.context import PhaseContext
from orchestrator.runtime.background_training import BackgroundTraining
from orchestrator.runtime.phases import aggregate, engine, evaluation, prepare, publish, rollout, sync, train

Work = Callable[[PhaseContext], "dict | None"]
Decide = Callable[[PhaseContext, "dict[int, dict]"], dict]

WORK: dict[Phase, Work] = {
    Phase.ROLLOUT: rollout.generate_train_shard,
    Phase.ROLLOUT_DONE: rollout.seal_train_shard,
    Phase.AGGREGATE: aggregate.merge_train_shards,
    Phase.EVAL: evaluation.run_eval_share,
    Phase.ENGINE_STOP: engine.stop,
    Phase.PREPARE: prepare.check_training_data,
    Phase.TRAIN: train.train,
    Phase.PUBLISH: publish.publish_checkpoint,
    Phase.ENGINE_RESTART: engine.restart,
    Phase.SYNC_END: sync.prune_checkpoints,
}

DECIDE: dict[Phase, Decide] = {
    Phase.SYNC_START: sync.plan_iteration,
    Phase.SHARDS_SEALED: aggregate.verify_seals,
    Phase.EVAL_DECIDE: evaluation.decide,
    Phase.EVAL: evaluation.aggregate_results,
    Phase.TRAIN_CONFIG: prepare.training_plan,
    Phase.PUBLISH: publish.announce,
    Phase.SYNC_END: sync.finish_iteration,
}


def no_decision(ctx: PhaseContext, arrivals: dict[int, dict]) -> dict:
    return {}


def _launch_training(training: BackgroundTraining) -> tuple[Work, Decide]:
    """Phase 10: every rank hands its part of the training to its training thread, and goes on."""
    return (lambda ctx: training.launch(ctx, train.train)), no_decision


def _publish_after_training(training: BackgroundTraining) -> tuple[Work, Decide]:
    """Phase 11: every rank waits for its part of the training; once all arrived, every part
    is done, and the master publishes the checkpoint as the phase's decision."""
    return (lambda ctx: training.finish(ctx, train.train)), publish.publish_as_decision


# rl.max_staleness >= 1: (work, decide) of the phases the pipelined order splits the training
# over (protocol/schedule.py); every rank does the work, whatever the phase table's actor.
PIPELINED: dict[Phase, Callable[[BackgroundTraining], tuple[Work, Decide]]] = {
    Phase.TRAIN: _launch_training,
    Phase.PUBLISH: _publish_after_training,
}
