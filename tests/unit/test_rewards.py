"""The shipped rewards: exact match, and the final answer of a math completion."""

import threading

import pytest

from orchestrator.plugins import rewards


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("first \\boxed{3}, then \\boxed{x^{2}+1}", "x^{2}+1"),  # the last box, nested braces kept
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),  # GSM8K
    ("I think 3, then 1,000.", "1,000"),  # the last number
    ("it is 83, or so", "83"),  # a comma after it is the sentence's
    ("no answer here", None),
])
def test_final_answer(text, expected):
    assert rewards.final_answer(text) == expected


def test_reference_without_a_marker_is_kept_whole():
    assert rewards.final_answer("\\frac{3}{4}", whole=True) == "\\frac{3}{4}"
    assert rewards.final_answer("x #### 1,024", whole=True) == "1,024"


@pytest.mark.parametrize("answer,completion,reward", [
    ("72", "She sold 72 clips. \\boxed{72}", 1.0),
    ("Natalia sold ... #### 72", "so 72", 1.0),
    ("1000", "\\boxed{1,000}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("3/4", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("72", "\\boxed{71}", 0.0),
    ("72", "I do not know", 0.0),
    ("72", "\\boxed{}", 0.0),
    ("72", "\\boxed{7\ufffd2}", 0.0),  # undecodable bytes
    ("72", "\\boxed{72\x02}", 0.0),  # a control character
    ("0.5", "\\boxed{.5}", 1.0),
    ("20", "the sum is .2", 0.0),
])
@pytest.mark.parametrize("verifier", ["math-verify", "normalized"])
def test_math_reward(answer, completion, reward, verifier, monkeypatch):
    if verifier == "normalized":
        monkeypatch.setattr(rewards, "_math_verify", lambda reference, predicted: None)
    else:
        pytest.importorskip("math_verify")  # in the test extra; the fallback is tested either way
    assert rewards.math({"id": "t", "answer": answer}, completion) == reward


def test_plain_numbers_are_compared_without_math_verify_unless_they_are_close(monkeypatch):
    asked = []
    monkeypatch.setattr(rewards, "_math_verify", lambda reference, predicted: asked.append((reference, predicted)))
    assert rewards.math({"answer": "72"}, "\\boxed{72}") == 1.0
    assert rewards.math({"answer": "72"}, "\\boxed{71.5}") == 0.0
    assert rewards.math({"answer": "1/3"}, "\\boxed{0.33333}") == 0.0  # close: math-verify decides (here: nobody)
    assert rewards.math({"answer": "1000"}, "\\boxed{1,000}") == 1.0  # a separator: math-verify decides
    assert asked == [("1/3", "0.33333"), ("1000", "1,000")]


def test_math_reward_runs_in_threads_as_the_rollout_calls_it():
    pytest.importorskip("math_verify")
    results = []
    t = threading.Thread(target=lambda: results.append(rewards.math({"answer": "\\frac{1}{2}"}, "\\boxed{0.5}")))
    t.start()
    t.join(timeout=60)
    assert results == [1.0]


def test_rewards_load_by_name():
    assert rewards.load("orchestrator.rewards:math") is rewards.math
    with pytest.raises(ValueError, match="has no function"):
        rewards.load("orchestrator.rewards:nope")
