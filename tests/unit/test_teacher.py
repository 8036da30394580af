"""The teacher's log-probs of a record (workloads/rl/teacher.py) against a scripted scoring
engine: every sample's ids scored in one request per prompt, 0.0 where the loss mask is 0, an
agent's segments scored against their own prompts, and an answer for other ids refused."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.engine.client import Completion
from orchestrator.workloads.rl.engine_requests import Answer
from orchestrator.workloads.rl.teacher import Teacher, TeacherFailed


class Scoring:
    """Scores id k of a prompt as -k/10 (its value), and keeps the requests."""

    def __init__(self, wrong: bool = False):
        self.requests, self.wrong = [], wrong

    async def complete(self, request):
        self.requests.append(request)
        start = request.score_from
        groups = [[Completion("", "length", [-t / 10 for t in p[start:]][: -1 if self.wrong else None], None, list(p[start:]), list(p))]
                  for p in request.prompts]
        return Answer(request, groups, 0.0, 0.0)


def score(record, engine):
    return asyncio.run(Teacher(engine, "teacher").score(record))


def test_each_samples_ids_are_scored_in_one_request_with_context_ids_zero():
    engine = Scoring()
    record = {"task_id": "t1", "prompt_token_ids": [1, 2], "samples": [
        {"token_ids": [5, 6, 7], "loss_mask": [1, 0, 1]}, {"token_ids": [8], "logprobs": [-1.0]}, {"token_ids": [], "reward": 0.0}]}
    out = score(record, engine)
    assert [s["teacher_logprobs"] for s in out["samples"]] == [[-0.5, 0.0, -0.7], [-0.8], []]
    assert len(engine.requests) == 1 and engine.requests[0].score_from == 2 and engine.requests[0].prompts == [[1, 2, 5, 6, 7], [1, 2, 8]]
    assert out["samples"][1]["logprobs"] == [-1.0] and record["samples"][0].get("teacher_logprobs") is None, "the record is not changed"


def test_a_sample_scored_already_is_kept_and_not_scored_again():
    """A complete group carried past a rank's share was scored when it completed; a carried
    group's samples that finished before the stop were not (an unfinished record is not scored)."""
    engine = Scoring()
    record = {"task_id": "t1", "prompt_token_ids": [1], "samples": [{"token_ids": [4], "teacher_logprobs": [-9.0]}, {"token_ids": [6]}]}
    assert [s["teacher_logprobs"] for s in score(record, engine)["samples"]] == [[-9.0], [-0.6]]
    assert [r.prompts for r in engine.requests] == [[[1, 6]]]
    engine = Scoring()
    assert score({**record, "samples": record["samples"][:1]}, engine)["samples"] == record["samples"][:1] and not engine.requests


def test_an_agents_segments_are_scored_against_their_own_prompts():
    engine = Scoring()
    record = {"task_id": "t1", "prompt_token_ids": [1], "samples": [
        {"token_ids": [4, 5], "loss_mask": [0, 1], "segments": [{"prompt_token_ids": [9, 9, 9], "token_ids": [3], "loss_mask": [1]}]}]}
    (s,) = score(record, engine)["samples"]
    assert s["teacher_logprobs"] == [0.0, -0.5] and s["segments"][0]["teacher_logprobs"] == [-0.3]
    assert sorted(r.score_from for r in engine.requests) == [1, 3]


def test_an_answer_for_other_ids_than_those_sent_is_refused():
    with pytest.raises(TeacherFailed, match="scored 1 ids of task t1's sample, not the 2 sent"):
        score({"task_id": "t1", "prompt_token_ids": [1], "samples": [{"token_ids": [4, 5]}]}, Scoring(wrong=True))


class Flipping:
    """A scoring's future that the stages' thread finishes between two looks at it."""

    def __init__(self, record):
        self.record, self.looks = record, 0

    def done(self):
        self.looks += 1
        return self.looks > 1

    def result(self):
        return {**self.record, "scored": True}


def test_a_record_the_teacher_finishes_while_the_pipe_looks_is_returned_once_never_lost():
    from orchestrator.workloads.rl.rollout_pipe import RLRolloutPipe

    pipe = RLRolloutPipe.__new__(RLRolloutPipe)  # the stages' step alone (_staged)
    pipe.stages, pipe._scoring = ["the teacher"], []
    pipe.inflight = type("I", (), {"spawn": staticmethod(lambda coroutine: coroutine)})()
    pipe._through = Flipping
    first = pipe._staged([{"task_id": "t1"}, {"task_id": "t2", "unfinished": True}])
    assert first == [{"task_id": "t2", "unfinished": True}] and len(pipe._scoring) == 1, "t1 is being scored; t2 is not scored"
    assert pipe._staged([]) == [{"task_id": "t1", "scored": True}] and pipe._scoring == []
