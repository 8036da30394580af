"""The LLM judge (plugins/judge.py, workloads/rl/judge.py): its prompt filled in for a task and a
completion, its reply read as a verdict or a score, and a group's unscored samples judged in
one request against a scripted judge engine, whatever cannot be judged a reward error."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.config import JudgeConfig
from orchestrator.engine.client import Completion
from orchestrator.plugins import judge as words
from orchestrator.workloads.rl.engine_requests import Answer
from orchestrator.workloads.rl.judge import Judge


def test_the_template_shows_the_question_the_completion_the_answer_and_any_column():
    task = {"id": "t1", "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
            "answer": "4", "level": 3}
    assert words.render("{question}|{completion}|{answer}|{task[level]}|{{}}", task, "\\boxed{4}") == "What is 2+2?|\\boxed{4}|4|3|{}"
    assert words.render(words.DEFAULT_TEMPLATE, {"prompt": "2+2=", "answer": "4"}, "5").startswith("Question: 2+2=\nReference answer: 4\n")
    with pytest.raises(KeyError):
        words.render("{task[missing]} {completion}", task, "x")


@pytest.mark.parametrize("reply, reward", [("yes", 1.0), ("No.", 0.0), ("It is correct", 1.0), ("Incorrect!", 0.0),
                                           ("right... no, wrong", 0.0), ("no, wait: YES", 1.0), ("TRUE", 1.0)])
def test_a_verdict_is_its_last_word_of_judgement(reply, reward):
    assert words.score(reply, "verdict") == reward


def test_a_score_is_its_last_number_over_the_most_and_a_reply_without_one_is_unjudged():
    assert words.score("Steps 1 and 2 are fine. Score: 7", "score", 10) == 0.7
    assert words.score("4.5", "score", 5) == 0.9
    for reply, parse in [("maybe", "verdict"), ("nothing", "score"), ("11", "score"), ("-1", "score")]:
        with pytest.raises(words.Unjudged):
            words.score(reply, parse, 10)


class Tokenizer:
    """Each character one id; no chat template."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}


class Engine:
    """Answers each prompt with the reply its text asks for (after 'says:'), keeping the requests."""

    def __init__(self):
        self.requests = []

    async def complete(self, request):
        self.requests.append(request)
        replies = ["".join(map(chr, p)).split("says:")[1] for p in request.prompts]
        return Answer(request, [[Completion(r, "stop", None, None)] for r in replies], 0.0, 0.0)


def judge(template="{completion} says:{completion}", context=None, max_tokens=4):
    return Judge(Engine(), JudgeConfig(model="j", max_tokens=max_tokens), template, Tokenizer(), context, {"t1": {"id": "t1", "prompt": "p", "answer": "a"}},
                 "0:train:1:judge")


def test_a_groups_unscored_samples_are_judged_in_one_request_and_their_replies_kept():
    j = judge()
    record = {"task_id": "t1", "samples": [{"text": "yes"}, {"text": "no"}, {"text": "hmm"}, {"text": "yes", "reward": 0.25}]}
    out = asyncio.run(j.score(record))["samples"]
    assert [s["reward"] for s in out] == [1.0, 0.0, 0.0, 0.25]
    assert [s.get("judge_reply") for s in out] == ["yes", "no", "hmm", None], "the judge's words are kept; a scored sample is not asked"
    assert "reward_error" not in out[0] and "has no verdict" in out[2]["reward_error"] and "judge.model=j" in out[2]["reward_error"]
    assert len(j.inflight.requests) == 1 and len(j.inflight.requests[0].prompts) == 3 and record["samples"][0] == {"text": "yes"}
    again = judge()
    asyncio.run(again.score(record))
    assert again.inflight.requests[0].seed == j.inflight.requests[0].seed, "the judge's draws are the run's, not chance's"


def test_a_question_that_cannot_be_asked_is_the_samples_reward_error_and_the_rest_are_judged():
    out = asyncio.run(judge("{task[level]} {completion} says:{completion}").score({"task_id": "t1", "samples": [{"text": "yes"}]}))
    assert out["samples"][0]["reward"] == 0.0 and "KeyError: 'level'" in out["samples"][0]["reward_error"]
    j = judge(context=22)  # 'yes says:yes' (12 ids) leaves 10, the reply at most 4 (judge.max_tokens); the longer one leaves 4 < 8
    out = asyncio.run(j.score({"task_id": "t1", "samples": [{"text": "yes"}, {"text": "yes, yes, yes"}]}))["samples"]
    assert out[0]["reward"] == 1.0 and "leaves no room for a reply of 8 in the judge model's context of 22" in out[1]["reward_error"]
    assert len(j.inflight.requests[0].prompts) == 1 and j.inflight.requests[0].max_tokens == 4
    j = judge(context=22, max_tokens=256)  # the reply at most what the context leaves: 10
    asyncio.run(j.score({"task_id": "t1", "samples": [{"text": "yes"}]}))
    assert j.inflight.requests[0].max_tokens == 10
