"""The guide's number-guessing environment (examples/environments/guess_number.py), played by
hand as docs/environments.md suggests: a binary search finds every number within seven
turns, wrong guesses cost 0.1 each, a reply without a number ends the game."""

import importlib.util
from pathlib import Path

from orchestrator.environments import Step

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "environments" / "guess_number.py"


def _module():
    spec = importlib.util.spec_from_file_location("guess_number", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def play(env, low=1, high=100):
    """A binary search; the steps it took."""
    steps = []
    while True:
        guess = (low + high) // 2
        step = env.step(f"My guess is {guess}")
        steps.append(step)
        if step.done:
            return steps
        (hint,) = step.observation
        assert hint["role"] == "user"
        low, high = (guess + 1, high) if hint["content"] == "higher" else (low, guess - 1)


def test_a_binary_search_finds_every_number_within_seven_turns():
    GuessNumber = _module().GuessNumber
    for secret in range(1, 101):
        env = GuessNumber({"id": f"t{secret}", "prompt": "", "answer": str(secret)})
        assert env.reset()[0]["role"] == "user"
        steps = play(env)
        assert len(steps) <= 7 and abs(steps[-1].reward - (1.0 - 0.1 * (len(steps) - 1))) < 1e-9
        assert all(s.reward == 0.0 and not s.done for s in steps[:-1])


def test_a_reply_without_a_number_ends_the_game_with_nothing():
    env = _module().GuessNumber({"id": "t", "prompt": "", "answer": "37"})
    assert env.step("I do not know") == Step(reward=0.0, done=True)
    assert env.step("50").observation == [{"role": "user", "content": "lower"}]
