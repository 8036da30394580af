"""A game over several turns: the model guesses a number, the environment answers "higher"
or "lower", until it is found or the turns run out (rl.max_turns).

The number is the task's ``answer``, so any task file with an ``id`` and an ``answer`` column
from 1 to 100 plays it; the task's ``prompt`` is not used. Run it with:

    PYTHONPATH=examples/environments orchestrator run ... rl.environment=guess_number:GuessNumber rl.max_turns=7

A found number scores 1 less 0.1 a wrong guess before it, so a binary search (at most seven
guesses) scores at least 0.4 and a lucky first guess 1.0; a reply without a number ends the
game with 0.
"""

from __future__ import annotations

import re

from orchestrator.environments import Step

RULES = "I picked a whole number from 1 to 100. Guess it: reply with the number alone. I will say higher or lower."


class GuessNumber:
    def __init__(self, task: dict):
        self.secret = int(task["answer"])
        self.wrong = 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": RULES}]

    def step(self, completion: str) -> Step:
        numbers = re.findall(r"-?\d+", completion)
        if not numbers:
            return Step(reward=0.0, done=True)
        guess = int(numbers[-1])
        if guess == self.secret:
            return Step(reward=max(0.0, 1.0 - 0.1 * self.wrong), done=True)
        self.wrong += 1
        return Step(observation=[{"role": "user", "content": "higher" if guess < self.secret else "lower"}])
