"""The demo's warm start walks into the accuracy band: stops at the first check inside it,
rolls back and slows down when a check jumps over it, and fails clearly when it cannot land.
A fake trainer stands in for the model (its accuracy is a function of how far it has
trained); demo-data's end-to-end tests run the real one. What it teaches and grades is the
task's format: the default demo's answer, or the chat demo's ``\\boxed{}`` one."""

import pytest

from orchestrator.plugins import rewards
from orchestrator.demo.warm_start import CHAT, CHECK_EVERY, MAX_ROLLBACKS, PLAIN, Band, WarmStartError, _Examples, to_band

BAND = Band(0.25, 0.40)


class FakeTrainer:
    """Accuracy is ``curve(position)``; each step moves ``position`` by the learning rate."""

    def __init__(self, curve, lr=1.0):
        self.curve, self.lr, self.position, self.checks = curve, lr, 0.0, []

    def train(self, steps):
        self.position += steps * self.lr
        return [1.0] * steps

    def accuracy(self):
        self.checks.append(self.position)
        return self.curve(self.position)

    def snapshot(self):
        return self.position, self.lr

    def restore(self, snapshot):
        self.position, self.lr = snapshot


def cliff(start, width):
    """0 before ``start``, then up linearly to 1 over ``width``."""
    return lambda x: min(1.0, max(0.0, (x - start) / width))


def test_stops_at_the_first_check_inside_the_band():
    trainer = FakeTrainer(cliff(100, 100))
    result = to_band(trainer, band=BAND, max_steps=1000)
    assert result.steps == 125 and result.steps % CHECK_EVERY == 0
    assert BAND.low <= result.validation_accuracy <= BAND.high and result.rollbacks == 0
    assert len(result.losses) == result.steps


def test_a_check_past_the_band_goes_back_to_the_last_check_and_walks_on_at_half_the_rate():
    # 0.20 at step 110, 0.45 at step 115: the check every 5 steps jumps over the band.
    trainer = FakeTrainer(cliff(106, 20))
    result = to_band(trainer, band=BAND, max_steps=1000)
    assert result.rollbacks == 1 and trainer.lr == 0.5 and result.lr == 0.5
    assert BAND.low <= result.validation_accuracy <= BAND.high
    assert result.steps == 112, "one step at a time from step 110, at half the rate"
    assert len(result.losses) == result.steps, "the discarded steps' losses are gone too"


def test_gives_up_after_halving_the_rate_and_still_jumping_over():
    trainer = FakeTrainer(lambda x: 0.0 if x < 50 else 0.9)
    with pytest.raises(WarmStartError, match=r"jumped over the band \[0.25, 0.40\].*--accuracy-band"):
        to_band(trainer, band=BAND, max_steps=10_000)
    assert trainer.lr == pytest.approx(1.0 / 2**MAX_ROLLBACKS)


def test_the_step_cap_ends_the_walk_with_what_to_do():
    trainer = FakeTrainer(cliff(10_000, 100))
    with pytest.raises(WarmStartError, match=r"0\.000 after 40 warm-start steps.*--max-warm-steps"):
        to_band(trainer, band=BAND, max_steps=40)


def test_a_model_already_above_the_band_is_refused():
    with pytest.raises(WarmStartError, match="already scores 0.500"):
        to_band(FakeTrainer(lambda x: 0.5), band=BAND, max_steps=100)


@pytest.mark.parametrize("low,high", [(0.4, 0.25), (-0.1, 0.2), (0.2, 1.5), (0.3, 0.3)])
def test_a_band_must_be_an_interval_inside_zero_one(low, high):
    with pytest.raises(ValueError, match="0 <= low < high <= 1"):
        Band(low, high)


def test_the_default_demo_learns_its_answer_after_the_prompt_as_before_the_chat_demo(tmp_path):
    from transformers import AutoTokenizer

    from orchestrator.demo import tokenizer as demo_tokenizer

    demo_tokenizer.save(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    examples = _Examples(tok, [{"id": "1", "prompt": "17+25=", "answer": "42"}], PLAIN)
    prompt, answer = tok("17+25=")["input_ids"], tok("42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert prompt[0] == tok.bos_token_id
    assert examples.rows == [prompt + answer] and examples.labels == [[-100] * len(prompt) + answer]
    assert PLAIN.max_new_tokens == 4 and PLAIN.correct({"answer": "42"}, "42") and not PLAIN.correct({"answer": "42"}, " 42")


@pytest.mark.parametrize("completion", ["\\boxed{42}", "\\boxed{ 42 }", "\\boxed{41}", "\\boxed{42", "\\boxed{4}2", "42", "", "\\boxed{}",
                                        "\\boxed{4}\\boxed{42}"])
def test_the_chat_demo_grades_a_completion_as_the_math_reward_does(completion):
    task = {"id": "1", "prompt": [{"role": "user", "content": "What is 17+25?"}], "answer": "42"}
    assert CHAT.correct(task, completion) == (rewards.math(task, completion) == 1.0)
    assert CHAT.target(task) == "\\boxed{42}"
