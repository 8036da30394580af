"""Tasks reasoning-gym generates by name (data.train_file=reasoning_gym:<names>): the same on
every rank, seeded from the run's seed, train and test disjoint, shared by the datasets and
interleaved; scored by orchestrator.rewards:reasoning_gym with each dataset's own scorer."""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("reasoning_gym")

from orchestrator import rewards  # noqa: E402
from orchestrator.config import RunConfig  # noqa: E402
from orchestrator.data import reasoning_gym_tasks, tasks  # noqa: E402
from orchestrator.errors import ConfigError  # noqa: E402
from orchestrator.phase_table import RLPhase  # noqa: E402

SPEC = "reasoning_gym:basic_arithmetic+lcm"


def _config(tmp_path, seed=0, **data) -> RunConfig:
    from orchestrator.config import DataConfig

    return RunConfig(data_path=tmp_path, log_path=tmp_path / "run", seed=seed, rl_phase=RLPhase.BOTH, eval_interval=1, rank=0,
                     data=DataConfig(train_file=SPEC, test_file=SPEC, **data))


def test_each_split_is_generated_alike_from_the_seed_shared_by_the_datasets_and_disjoint(tmp_path):
    config = _config(tmp_path, train_size=21, test_size=10)
    train, test = (tasks.read(tasks.for_split(config, split)) for split in ("train", "eval"))
    assert len(train) == 21 and len(test) == 10
    assert collections.Counter(t["data_source"] for t in train) == {"basic_arithmetic": 11, "lcm": 10}
    assert [t["data_source"] for t in test[:4]] == ["basic_arithmetic", "lcm"] * 2, "interleaved: any first tasks cover both"
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    assert test[0]["id"] == "basic_arithmetic-test-0" and train[1]["id"] == "lcm-0"
    first = train[0]
    assert first["prompt"] == [{"role": "user", "content": first["question"]}] and first["metadata"]["source_dataset"] == "basic_arithmetic"
    again = reasoning_gym_tasks.rows(SPEC, "train", seed=0, train_size=21, test_size=10)
    assert [r["question"] for r in again] == [t["question"] for t in train], "every rank generates the same"
    other = tasks.read(tasks.for_split(_config(tmp_path, seed=1, train_size=21, test_size=10), "train"))
    assert [t["question"] for t in other] != [t["question"] for t in train], "another seed, other tasks"


def test_a_train_question_the_test_split_holds_is_skipped_for_the_next():
    # lcm of small numbers repeats: at these sizes some train questions are test questions
    test = reasoning_gym_tasks.rows("reasoning_gym:lcm", "eval", seed=3, train_size=300, test_size=300)
    train = reasoning_gym_tasks.rows("reasoning_gym:lcm", "train", seed=3, train_size=300, test_size=300)
    assert len(train) == 300 and not {t["question"] for t in train} & {t["question"] for t in test}


def test_an_unknown_dataset_names_the_key_and_the_closest_names(tmp_path):
    from orchestrator.config import DataConfig

    config = RunConfig(data_path=tmp_path, log_path=tmp_path / "run", rl_phase=RLPhase.BOTH, eval_interval=1, rank=0,
                       data=DataConfig(train_file="reasoning_gym:basic_arithmetik"))
    with pytest.raises(ConfigError, match=r"data.train_file=reasoning_gym:basic_arithmetik: reasoning-gym has no dataset "
                                          r"'basic_arithmetik'; did you mean basic_arithmetic"):
        tasks.read(tasks.for_split(config, "train"))


def test_the_reward_is_the_datasets_own_score_of_the_tagged_boxed_or_whole_answer():
    (task,) = reasoning_gym_tasks.rows("reasoning_gym:basic_arithmetic", "eval", seed=0, train_size=1, test_size=1)
    right = task["answer"]
    assert rewards.reasoning_gym(task, f"thinking... <answer> {right} </answer>") == 1.0
    assert rewards.reasoning_gym(task, f"so \\boxed{{{right}}}") == 1.0
    assert rewards.reasoning_gym(task, f" {right}\n") == 1.0
    assert rewards.reasoning_gym(task, "<answer>no</answer>") == 0.0
    with pytest.raises(ValueError, match="no reasoning-gym dataset in metadata.source_dataset"):
        rewards.reasoning_gym({"id": "t", "answer": "1"}, "1")
