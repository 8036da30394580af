"""Token-exact turns (data/turns.py) with the chat demo's ChatML tokenizer: the next
turn's prompt is the ids sampled and the observation's ids as the template renders them,
nothing sampled tokenized again; and the environment seam (environments.py)."""

from __future__ import annotations

import pytest

from orchestrator.plugins import environments
from orchestrator.data import turns


@pytest.fixture(scope="module")
def tokenizer():
    from orchestrator.demo import chat_tokenizer, tasks, warm_start

    return chat_tokenizer.fast(chat_tokenizer.corpus(tasks.make_tasks(0, chat=True)["train"][:200], warm_start.CHAT.target))


def test_a_conversation_whose_model_sampled_the_canonical_ids_is_the_templates_rendering(tokenizer):
    opening = [{"role": "user", "content": "What is 12*3?"}]
    tool = [{"role": "tool", "content": "36"}]
    prompt = turns.render(tokenizer, opening, generation_prompt=True)
    answer = tokenizer("<calc>12*3</calc>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    c = turns.Conversation(prompt)
    c.sampled(answer, [-0.1] * len(answer), "<calc>12*3</calc>")
    c.observed(tool, c.observation(tokenizer, tool))
    whole = turns.render(tokenizer, opening + [{"role": "assistant", "content": "<calc>12*3</calc>"}] + tool, generation_prompt=True)
    assert c.context == whole
    assert c.loss_mask == [1] * len(answer) + [0] * (len(whole) - len(prompt) - len(answer))
    assert len(c.logprobs) == len(c.token_ids) and c.turns[0]["observation"] == tool


def test_sampled_ids_stay_as_sampled_and_a_turn_cut_at_a_stop_string_is_closed(tokenizer):
    prompt = turns.render(tokenizer, [{"role": "user", "content": "1+1?"}], generation_prompt=True)
    odd = [tokenizer.convert_tokens_to_ids(ch) for ch in "answer"]  # one id a character: not how "answer" tokenizes
    assert odd != tokenizer("answer", add_special_tokens=False)["input_ids"]
    c = turns.Conversation(prompt)
    c.sampled(odd, [-0.5] * len(odd), "answer")
    obs = turns.observation_ids(tokenizer, [{"role": "tool", "content": "2"}])
    c.observed([{"role": "tool", "content": "2"}], c.observation(tokenizer, [{"role": "tool", "content": "2"}]))
    assert c.token_ids == odd + [tokenizer.eos_token_id] + obs  # closed with the end of turn, as context
    assert c.loss_mask == [1] * len(odd) + [0] * (1 + len(obs))
    assert tokenizer.decode(obs).startswith("\n<|im_start|>tool\n2<|im_end|>") and tokenizer.decode(obs).endswith("<|im_start|>assistant\n")


def test_the_environment_seam(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from orchestrator.environments import Step\n"
        "class Guess:\n"
        "    def __init__(self, task): self.task = task\n"
        "    def reset(self): return [{'role': 'user', 'content': 'guess'}]\n"
        "    def step(self, completion): return Step(reward=1.0, done=True)\n"
        "class NoStep:\n"
        "    def reset(self): return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert environments.load("my_envs:Guess").__name__ == "Guess"
    for spec, says in (("my_envs", "not of the form module:Class"), ("nope_envs:X", "cannot import"),
                       ("my_envs:Missing", "has no class Missing"), ("my_envs:NoStep", "has no step method")):
        with pytest.raises(ValueError, match=says):
            environments.load(spec)
    one = environments.OneTurn({"prompt": "1+1=", "answer": "2"})
    assert one.reset() == [{"role": "user", "content": "1+1="}] and one.step(" 2 ") == environments.Step(reward=1.0, done=True)
    with pytest.raises(ValueError, match="Step.observation"):
        environments.Step(observation=[{"role": "tool"}])
    with pytest.raises(ValueError, match="Step.reward"):
        environments.Step(reward=float("nan"))
