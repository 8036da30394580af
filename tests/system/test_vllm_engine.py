"""A real vLLM server on the demo model (orchestrator.engine.vllm): the rollout's client
against it, in-place weight reload, sleep and wake-up.

One server for the module (about 45 s to start on 2 CPU cores), started with
serve_command / serve_env as a rank would. Logprobs are checked against a forward pass of the
same checkpoint in this process (teacher-forced on the tokens vLLM generated, so that a near
tie of a random model cannot make the two pick different tokens).
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (scripts/setup-vllm.sh installs it)", allow_module_level=True)

from orchestrator.engine import vllm
from orchestrator.engine.client import Completion, EngineClient, EngineUnavailable
from orchestrator.node.ports import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300)]

NAME = "policy-test"
STARTUP_S = 240.0
SHORT = "17+25="
# 40 characters + BOS: one full 32-token KV block, which the prefix cache keeps (the server
# runs with --block-size 32), so a reload that left the cache alone would be caught.
LONG = "12+34 56+78 90+12 34+56 78+90 11+22 3+4="
TOL = 1e-3
PROMPT_LOGPROBS_TOL = 2e-3
BOS = 1  # the demo tokenizer's


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    base: Path  # the checkpoint it started on
    other: Path  # same architecture, other weights

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), SIGKILL what is
    left after a grace period."""
    for sig, grace_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the leader is gone; its children go too
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    from orchestrator.demo import model

    dirs = []
    for seed in (0, 1):
        d = tmp_path_factory.mktemp(f"ckpt{seed}")
        model.save(model.create(seed), d)
        dirs.append(d)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    base, other = checkpoints
    port = free_port(18200)
    argv = vllm.serve_command(
        model=str(base), served_model_name=NAME, port=port, host="127.0.0.1", dtype="float32",
        gpu_memory_utilization=0.1, extra_args="--enforce-eager --block-size 32",
    )
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=vllm.serve_env(gpus=(), base=os.environ), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    s = Server(f"http://127.0.0.1:{port}", proc, log, base, other)
    try:
        try:
            EngineClient(s.url, timeout_s=10).wait_healthy(STARTUP_S, should_stop=lambda: proc.poll() is not None)
        except EngineUnavailable as e:
            pytest.fail(f"vLLM did not come up (exit code {proc.poll()}): {e}\n{s.tail()}", pytrace=False)
        yield s
    finally:
        _stop_group(proc)


@pytest.fixture
def client(server) -> EngineClient:
    return EngineClient(server.url, timeout_s=120, model=NAME)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """logprobs(checkpoint, prompt, token_ids): each token's logprob under a forward pass."""
    import torch

    from orchestrator.demo import model

    loaded = {d: model.load(d) for d in checkpoints}

    def logprobs(checkpoint: Path, prompt: str, token_ids: list[int]) -> list[float]:
        m, tokenizer = loaded[checkpoint]
        prompt_ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logits = m(torch.tensor([prompt_ids + token_ids])).logits[0]
        lp = torch.log_softmax(logits.float(), dim=-1)
        return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(token_ids)]

    return logprobs


def _greedy(client: EngineClient, prompt: str) -> Completion:
    [[c]] = client.complete([prompt], n=1, temperature=0, max_tokens=8, logprobs=0, return_token_ids=True)
    return c


def _assert_serves(reference, checkpoint: Path, prompt: str, c: Completion) -> None:
    assert c.token_ids, c
    expected = reference(checkpoint, prompt, c.token_ids)
    assert c.token_logprobs == pytest.approx(expected, abs=TOL), f"not {checkpoint.name}'s logprobs for {prompt!r}"


def test_client_against_vllm(server, client, reference):
    assert client.models() == [NAME]
    for prompt in (SHORT, LONG):
        _assert_serves(reference, server.base, prompt, _greedy(client, prompt))

    prompts = ["1+2=", "12+34=", "49+49=", "7*8="]
    groups = client.complete(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=8, seed=3, logprobs=0)
    assert [len(g) for g in groups] == [4] * len(prompts)
    for g in groups:
        for c in g:
            assert c.finish_reason in ("stop", "length")
            assert len(c.token_logprobs) == len(c.tokens) <= 8
            assert all(lp <= 0 and math.isfinite(lp) for lp in c.token_logprobs)
    again = client.complete(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=8, seed=3, logprobs=0)
    assert [[c.text for c in g] for g in again] == [[c.text for c in g] for g in groups]  # seeded


def test_prompt_logprobs_of_token_ids_are_those_of_a_forward_pass(server, client, reference):
    # BOS then ids of the demo vocabulary, four lengths in one request (one of them near the
    # 64-token context), each scored from its own start: a teacher scoring a student's tokens.
    rng = random.Random(0)
    ids = [[rng.randrange(19) for _ in range(n)] for n in (1, 8, 31, 62)]
    starts = [1, 1, 12, 40]

    async def score():
        async with client.async_http(120) as http:
            return await client.aprompt_logprobs(http, [[BOS, *t] for t in ids], start=starts)

    scored = asyncio.run(score())
    for t, at, got in zip(ids, starts, scored, strict=True):
        expected = reference(server.base, "", t)  # "" is [BOS]
        assert got == pytest.approx(expected[at - 1 :], abs=PROMPT_LOGPROBS_TOL), f"{len(t) + 1} tokens from {at}"


def test_reload_weights_in_place(server, client, reference):
    before = _greedy(client, LONG)
    _greedy(client, LONG)  # LONG's first block is now in the prefix cache
    assert vllm.reload_weights(server.url, str(server.other), timeout_s=120) is True
    reloaded = _greedy(client, LONG)
    _assert_serves(reference, server.other, LONG, reloaded)  # not served from the stale cache
    assert reloaded.token_logprobs != pytest.approx(before.token_logprobs, abs=TOL)
    _assert_serves(reference, server.other, SHORT, _greedy(client, SHORT))

    assert vllm.reload_weights(server.url, str(server.base), timeout_s=120) is True
    restored = _greedy(client, LONG)
    assert restored.token_ids == before.token_ids
    assert restored.token_logprobs == pytest.approx(before.token_logprobs, abs=1e-5)
    assert server.proc.poll() is None


def test_reload_weights_refuses_a_non_checkpoint(server, client, reference, tmp_path):
    # vLLM 0.32 would try the path, fail half-way and kill its engine: it must never see it.
    with pytest.raises(FileNotFoundError):
        vllm.reload_weights(server.url, str(tmp_path / "missing"), timeout_s=120)
    _assert_serves(reference, server.base, SHORT, _greedy(client, SHORT))


def test_sleep_and_wake_up(server, client, reference):
    before = _greedy(client, SHORT)
    assert vllm.sleep(server.url, 1, timeout_s=60) is True
    assert vllm.wake_up(server.url, timeout_s=60) is True
    after = _greedy(client, SHORT)
    assert after.token_logprobs == pytest.approx(before.token_logprobs, abs=1e-5)

    # Level 2 discards the weights (on GPU; on CPU it frees nothing): reload before serving.
    assert vllm.sleep(server.url, 2, timeout_s=60) is True
    assert vllm.wake_up(server.url, timeout_s=60, tags=["weights"]) is True
    assert vllm.reload_weights(server.url, str(server.other), timeout_s=120) is True
    assert vllm.wake_up(server.url, timeout_s=60, tags=["kv_cache"]) is True
    _assert_serves(reference, server.other, LONG, _greedy(client, LONG))
    assert vllm.reload_weights(server.url, str(server.base), timeout_s=120) is True
    _assert_serves(reference, server.base, LONG, _greedy(client, LONG))
