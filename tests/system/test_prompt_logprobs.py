"""Prompt logprobs on the embedded engine (vLLM's ``prompt_logprobs``): a real server process
scores token-id prompts of different lengths sent together, and the client's
``aprompt_logprobs`` gets each token's log-prob as a forward pass of the same checkpoint in
this process gives it; the response has vLLM's shape, and a bad value is a 400."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from orchestrator.engine.client import EngineClient, EngineHTTPError
from tests.system.test_engine import MODEL_NAME, _http, engine, model_dir  # noqa: F401 - the engine test's module fixtures

TOL = 1e-3


@pytest.fixture(scope="module")
def forward(model_dir):
    """forward(ids): log_softmax of the checkpoint's logits at each position of ``ids``
    (positions, vocabulary), float32, from a forward pass in this process."""
    import torch

    from orchestrator.demo import model

    m, _ = model.load(model_dir)
    m.eval()

    def logprobs(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """BOS, then ids drawn from the demo vocabulary (19 tokens)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(19) for _ in range(n - 1)] for n in lengths]


def _expected(forward, ids: list[int], start: int) -> list[float]:
    lp = forward(ids)
    return [lp[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.mark.timeout(90)  # includes starting the module's engine
def test_prompt_logprobs_of_prompts_sent_together_are_those_of_a_forward_pass(engine, forward):
    client = EngineClient(engine.url, timeout_s=30, model=MODEL_NAME)
    batch = _prompts([2, 9, 33, 63], seed=0)  # 63 + the one token sampled: the demo model's whole context
    starts = [1, 4, 20, 62]
    alone = _prompts([17, 5], seed=1)

    async def send():
        async with client.async_http(30) as http:
            return await asyncio.gather(
                client.aprompt_logprobs(http, batch, start=starts),
                client.aprompt_logprobs(http, alone),
                client.acomplete(http, ["1+2=", "12+34="], n=2, max_tokens=8),  # sampling requests batch with them
            )

    scored, scored_alone, _ = asyncio.run(send())
    for ids, at, got in zip(batch, starts, scored, strict=True):
        assert len(got) == len(ids) - at
        assert got == pytest.approx(_expected(forward, ids, at), abs=TOL), f"prompt of {len(ids)} tokens from {at}"
    for ids, got in zip(alone, scored_alone, strict=True):
        assert got == pytest.approx(_expected(forward, ids, 1), abs=TOL)


@pytest.mark.timeout(20)
def test_prompt_logprobs_have_vllms_shape(engine, forward):
    [ids] = _prompts([12], seed=2)
    status, raw = _http(engine.url + "/v1/completions", "POST",
                        {"model": MODEL_NAME, "prompt": ids, "n": 2, "max_tokens": 1, "prompt_logprobs": 2})
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]  # each of the prompt's samples carries them
    positions = choices[0]["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    lp = forward(ids)
    for i, step in enumerate(positions[1:], start=1):
        own = step[str(ids[i])]  # always there, top two or not
        assert own["logprob"] == pytest.approx(lp[i - 1, ids[i]].item(), abs=TOL)
        assert own["rank"] == int((lp[i - 1] >= lp[i - 1, ids[i]]).sum())
        assert isinstance(own["decoded_token"], str)
        best = lp[i - 1].topk(2)
        for rank, (t, value) in enumerate(zip(best.indices.tolist(), best.values.tolist()), start=1):
            assert step[str(t)]["logprob"] == pytest.approx(value, abs=TOL)
            assert step[str(t)]["rank"] in (rank, own["rank"])  # the prompt's own token may tie with it
        assert len(step) == 3 - (str(ids[i]) in {str(t) for t in best.indices.tolist()})


@pytest.mark.timeout(20)
def test_a_bad_prompt_logprobs_or_max_tokens_0_is_a_400_with_an_openai_error_body(engine):
    for field, value, says in [("prompt_logprobs", -1, "between 0 and 20"), ("prompt_logprobs", 21, "between 0 and 20"),
                               ("prompt_logprobs", "2", "an integer"), ("prompt_logprobs", 1.5, "an integer"),
                               ("prompt_logprobs", True, "an integer"), ("max_tokens", 0, "at least 1")]:
        body = {"model": MODEL_NAME, "prompt": [1, 5, 6], "max_tokens": 1, "prompt_logprobs": 0, field: value}
        status, raw = _http(engine.url + "/v1/completions", "POST", body)
        assert status == 400, (field, value, raw)
        error = json.loads(raw)["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert field in error["message"] and says in error["message"], error["message"]


@pytest.mark.timeout(20)
def test_the_client_refuses_a_start_out_of_range_and_passes_on_the_engines_refusal(engine):
    client = EngineClient(engine.url, timeout_s=30, model=MODEL_NAME)

    async def score(prompts, start=1):
        async with client.async_http(30) as http:
            return await client.aprompt_logprobs(http, prompts, start=start)

    with pytest.raises(ValueError, match="start 0 of prompt 0"):
        asyncio.run(score([[1, 5]], start=0))
    with pytest.raises(ValueError, match="start 3 of prompt 1"):
        asyncio.run(score([[1, 5, 6], [1, 5]], start=3))
    assert asyncio.run(score([[1, 5, 6]], start=3)) == [[]]
    with pytest.raises(EngineHTTPError, match="maximum context length"):
        asyncio.run(score([[1] * 64]))  # no room for the one token sampled
