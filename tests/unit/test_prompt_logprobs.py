"""The sampler's prompt logprobs (``SamplingParams.prompt_logprobs``), in-process: computed
on the prefill that a scoring request shares with sampling requests, they are a forward pass's;
the sampling requests get what they get alone; a model that changes its logits after its head
is refused rather than scored wrong; the client reads vLLM's answer and names what is missing.

Tiny random-weight models of both demo architectures (Llama, Qwen2), float32."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.engine.client import EngineClient, EngineError
from orchestrator.engine.sampling import Batch, CannotScorePrompts, Sampler, SamplingParams
from tests import http_stub
from tests.unit.test_engine_batching import _chat_prompts, _run, _same, llama, qwen2  # noqa: F401 - fixtures

TOL = 1e-4  # the same float32 model in one process: only batch shapes move the last bits


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    model, tok = request.getfixturevalue(request.param)
    texts = ["1+2=", "12+34=", "7*8="] if request.param == "llama" else _chat_prompts(tok)[:3]
    return Sampler(model, tok), model, [tok(t)["input_ids"] for t in texts]


def _forward(model, ids: list[int], k: int):
    """Each token's logprob from the second on, and the k most likely at each of those positions."""
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    top = lp[:-1].topk(k, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], top.indices.tolist()


def test_a_scoring_request_prefilled_with_sampling_ones_gets_a_forward_passs_logprobs(arch):
    sampler, model, prompts = arch
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=7, logprobs=1)
    alone = sampler.generate(prompts[:1], sampling)

    before = sampler.request(prompts[:1], sampling)
    scoring = sampler.request(prompts[1:] + [prompts[0][:1]], SamplingParams(max_tokens=1, prompt_logprobs=3))
    batch = Batch()
    batch.join(sampler.prefill([before, scoring]))  # one forward pass, prompts of three lengths left-padded
    _run(sampler, batch, [before, scoring])

    _same(before.generation, alone)
    assert before.generation.prompt_logprobs is None
    scored = scoring.generation.prompt_logprobs
    assert len(scored) == 3 and scored[2].token_logprobs == []  # a one-token prompt has nothing to score
    for ids, got in zip(prompts[1:], scored[:2], strict=True):
        expected, top = _forward(model, ids, 3)
        assert got.token_logprobs == pytest.approx(expected, abs=TOL)
        assert [[t for t, _ in step] for step in got.top] == top
        assert all(rank >= 1 for rank in got.ranks)


def test_a_model_that_scales_its_logits_after_its_head_is_refused_prompt_logprobs(llama):
    import torch
    from transformers import GraniteConfig, GraniteForCausalLM

    _, tok = llama
    torch.manual_seed(0)
    scaled = GraniteForCausalLM(GraniteConfig(vocab_size=19, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=2, logits_scaling=4.0))
    sampler = Sampler(scaled, tok)
    with pytest.raises(CannotScorePrompts, match="serve this model with vLLM"):
        sampler.request([[1, 5, 6]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    sampler.generate([[1, 5, 6]], SamplingParams(max_tokens=2))  # sampling from it is as before


def test_the_client_reads_each_prompts_own_tokens_and_names_one_answered_without_them():
    sent = []
    scored = [None,
              {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}, "5": {"logprob": -1.5, "rank": 2, "decoded_token": "1"}},
              {"6": {"logprob": -9999.0, "rank": 19, "decoded_token": "2"}}]  # vLLM's -inf

    def answer(choices):
        async def handler(body, writer):
            sent.append(body)
            return http_stub.reply(writer, {"choices": choices})
        return handler

    async def score(handler, prompts):
        server = await http_stub.serve(handler)
        client = EngineClient(http_stub.url(server), timeout_s=5, model="teacher")
        try:
            async with client.async_http() as http:
                return await client.aprompt_logprobs(http, prompts, start=[1, 2][: len(prompts)])
        finally:
            server.close()

    got = asyncio.run(score(answer([{"index": 1, "prompt_logprobs": scored}, {"index": 0, "prompt_logprobs": scored}]),
                            [[1, 5, 6], [1, 5, 6]]))
    assert got == [[-1.5, -9999.0], [-9999.0]]
    assert sent[0] == {"model": "teacher", "prompt": [[1, 5, 6], [1, 5, 6]], "n": 1, "temperature": 0.0, "max_tokens": 1,
                       "prompt_logprobs": 0}
    with pytest.raises(EngineError, match=r"prompt 0 \(3 tokens\) with prompt_logprobs None \(finish_reason 'abort'\)"):
        asyncio.run(score(answer([{"index": 0, "finish_reason": "abort", "prompt_logprobs": None}]), [[1, 5, 6]]))
