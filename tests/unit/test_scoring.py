"""Scoring with the user's reward: a failure scores 0, is marked, and past the limit fails the rank."""

import pytest

from orchestrator.workloads.rl.scoring import RewardFailed, Scorer


def reward(task, completion):
    if completion == "raise":
        raise ValueError(f"cannot grade {task['id']}")
    return float("nan") if completion == "nan" else 1.0


def batch(*texts, task="t1"):
    scorer = Scorer(reward, "m:f", 0.0, "train")
    samples = []
    for text in texts:
        value, error = scorer.score({"id": task}, text)
        samples.append({"reward": value, **({"reward_error": error} if error else {})})
    return [{"task_id": task, "samples": samples}]


def test_a_failing_reward_scores_zero_with_its_traceback():
    scorer = Scorer(reward, "m:f", 0.5, "train")
    assert scorer.score({"id": "t1"}, "ok") == (1.0, None)
    value, error = scorer.score({"id": "t1"}, "raise")
    assert value == 0.0 and "Traceback" in error and error.rstrip().endswith("ValueError: cannot grade t1")
    value, error = scorer.score({"id": "t1"}, "nan")
    assert value == 0.0 and "not a finite number" in error


def test_the_limit_is_a_share_of_the_samples_scored_so_far():
    scorer = Scorer(reward, "m:f", 0.25, "train")
    scorer.check(batch("ok", "ok", "ok", "raise"))  # 1 of 4: at the limit, not past it
    assert (scorer.errors, scorer.samples, scorer.first[0]) == (1, 4, "t1")
    with pytest.raises(RewardFailed, match=r"m:f failed on 3 of 8 train samples.*first on task t1: ValueError: cannot grade t1"):
        scorer.check(batch("ok", "ok", "raise", "raise", task="t2"))


def test_a_zero_limit_fails_at_the_first_error_and_tolerates_none():
    scorer = Scorer(reward, "m:f", 0.0, "eval")
    scorer.check(batch("ok", "ok"))
    with pytest.raises(RewardFailed, match="1 of 3 eval samples"):
        scorer.check(batch("raise"))


def test_an_environments_failures_are_counted_alike_and_named_as_the_environments():
    scorer = Scorer(None, "rl.environment=my:Env", 0.0, "train")
    with pytest.raises(RewardFailed, match=r"rl.environment=my:Env failed on 1 of 2 train samples.*Fix the environment"):
        scorer.check([{"task_id": "t1", "samples": [{"reward": 1.0}, {"reward": 0.0, "reward_error": "Env.step() raised: boom"}]}])
