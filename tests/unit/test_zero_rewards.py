"""A run's first iteration whose every train sample scored 0 is warned of, naming the key
that graded them: the update learns nothing, and a reward that does not fit the tasks (the
chat demo's answers in \\boxed{} graded by exact_match) looks just like it."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config import RLConfig, RunConfig, WorkloadKind
from orchestrator.data import shards
from orchestrator.phase_table import RLPhase
from orchestrator.runtime.phases.aggregate import zero_rewards_warning

CALCULATOR = "orchestrator.demo.calculator:Calculator"


def _config(workload: WorkloadKind = WorkloadKind.RL, **rl) -> RunConfig:
    return RunConfig(data_path=Path("/data"), log_path=Path("/run"), rl_phase=RLPhase.BOTH, eval_interval=1, rank=0,
                     workload=workload, rl=RLConfig(**rl))


def _aggregate(folder: Path, rewards: list[list[float]]) -> dict:
    """The train aggregate's manifest's ``extra`` of one shard holding a record per task."""
    folder.mkdir(parents=True, exist_ok=True)
    shard = folder / "r00000.jsonl"
    shard.write_text("".join(json.dumps({"task_id": f"t{i}", "samples": [{"reward": r} for r in task]}) + "\n"
                             for i, task in enumerate(rewards)))
    shards.seal(shard, rank=0)
    return shards.merge([("rank 0", shard)], folder / "agg.jsonl").extra


def test_an_aggregate_counts_its_samples_whose_reward_is_not_zero(tmp_path):
    extra = _aggregate(tmp_path, [[0.0, 1.0, -0.5], [0.0, 0.0, 0.0]])
    assert (extra["trajectories"], extra["rewarded"]) == (6, 2)


def test_every_sample_of_the_first_iteration_scored_zero_warns_naming_the_reward(tmp_path):
    extra = _aggregate(tmp_path, [[0.0] * 4] * 8)
    warning = zero_rewards_warning(_config(), 1, extra)
    assert warning is not None and warning.startswith(
        "every one of the 32 train samples of iteration 1 scored 0 under rl.reward=orchestrator.rewards:exact_match: ")
    assert "orchestrator.rewards:math" in warning and warning.endswith(f"within rl.max_tokens={RLConfig().max_tokens}")
    with_env = zero_rewards_warning(_config(environment=CALCULATOR), 1, extra)
    assert f"under rl.environment={CALCULATOR}: " in with_env and "Check that rl.environment grades" in with_env


def test_a_reward_somewhere_a_later_iteration_a_rehearsal_or_an_older_aggregate_warn_of_nothing(tmp_path):
    zeros = _aggregate(tmp_path / "zeros", [[0.0] * 4] * 8)
    one = _aggregate(tmp_path / "one", [[0.0] * 4] * 7 + [[0.0, 0.0, 0.0, 1.0]])
    assert zero_rewards_warning(_config(), 1, one) is None
    assert zero_rewards_warning(_config(), 2, zeros) is None  # warned once, of the run's first iteration
    assert zero_rewards_warning(_config(WorkloadKind.REHEARSAL), 1, zeros) is None  # simulated rewards, no rl.reward
    assert zero_rewards_warning(_config(), 1, {k: v for k, v in zeros.items() if k != "rewarded"}) is None
