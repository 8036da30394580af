"""The embedded inference engine: the real server process, its vLLM-shaped HTTP contract, its
sampling semantics (checked against a forward pass of the same model), and the rollout's client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestrator.engine.client import EngineClient, EngineHTTPError, EngineUnavailable
from orchestrator.protocol import child_error
from tests.harness import free_port

MODEL_NAME = "tiny-llama"
PROMPTS = ["1+2=", "12+34=", "", "49+49=", "7*8="]
STARTUP_S = 60.0


class Engine:
    """A real server process, on a port it picked itself; its log is a file in tmp."""

    def __init__(self, model_dir: Path, log_path: Path, port_args: tuple[str, ...] = ("--port", "0")):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.engine.server", "--model", str(model_dir), *port_args,
             "--served-model-name", MODEL_NAME],
            stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True,
        )
        self.url = self._wait_for_url()
        EngineClient(self.url, timeout_s=10).wait_healthy(deadline_s=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            found = re.search(r"listening on (http://\S+)", self.log())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                pytest.fail(f"engine exited with {self.proc.returncode} before listening:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        pytest.fail(f"engine did not listen within {STARTUP_S}s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from orchestrator.demo import model

    directory = tmp_path_factory.mktemp("model")
    model.save(model.create(0), directory)
    return directory


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    e = Engine(model_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield e
    e.kill()


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same checkpoint loaded in the test process, for forward passes."""
    from orchestrator.demo import model

    m, tokenizer = model.load(model_dir)
    return m.eval(), tokenizer


@pytest.fixture
def client(engine) -> EngineClient:
    return EngineClient(engine.url, timeout_s=30)


def _http(url: str, method: str = "GET", body: bytes | dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def _complete(engine: Engine, **body) -> dict:
    status, raw = _http(engine.url + "/v1/completions", "POST", {"model": MODEL_NAME, **body})
    assert status == 200, raw
    return json.loads(raw)


# --- HTTP contract ---------------------------------------------------------------------------


@pytest.mark.timeout(90)  # includes starting the module's engine
def test_health_answers_200_with_an_empty_body(engine):
    assert _http(engine.url + "/health") == (200, b"")


@pytest.mark.timeout(20)
def test_models_lists_the_served_model_name(engine):
    status, raw = _http(engine.url + "/v1/models")
    body = json.loads(raw)
    assert status == 200
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [MODEL_NAME]
    assert body["data"][0]["object"] == "model"


@pytest.mark.timeout(20)
def test_completions_for_a_list_of_prompts_with_n_2_have_the_vllm_shape(engine, reference):
    _, tokenizer = reference
    prompts = PROMPTS[:3]
    body = _complete(engine, prompt=prompts, n=2, max_tokens=6, logprobs=2, seed=3, return_token_ids=True)

    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for c in choices:
        # index = prompt_index * n + sample_index, as vLLM numbers them
        assert c["prompt_token_ids"] == tokenizer(prompts[c["index"] // 2])["input_ids"]
        assert c["finish_reason"] in ("stop", "length")
        assert isinstance(c["text"], str)
        lp = c["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(c["token_ids"])
        assert lp["tokens"] == [tokenizer.decode([t]) for t in c["token_ids"]]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        for token, token_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert token_lp <= 0
            assert next(iter(top)) == token and top[token] == token_lp  # the sampled token comes first
            assert 2 <= len(top) <= 3
        if c["finish_reason"] == "length":
            assert len(c["token_ids"]) == 6
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(tokenizer(p)["input_ids"]) for p in prompts)  # once per prompt
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.timeout(20)
def test_completions_without_logprobs_have_null_logprobs(engine):
    body = _complete(engine, prompt="1+1=", max_tokens=3)
    assert body["choices"][0]["logprobs"] is None
    assert body["choices"][0]["token_ids"] is None


@pytest.mark.timeout(20)
def test_a_token_id_prompt_is_continued_as_its_text_would_be(engine, reference):
    """The ids of a text prompt, sent as ids (one prompt, or a list of them), give the same
    completions with the same seed: a multi-turn rollout sends its context as ids."""
    _, tokenizer = reference
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    as_text = _complete(engine, prompt=PROMPTS[:2], n=2, max_tokens=5, seed=7, logprobs=0, return_token_ids=True)
    as_ids = _complete(engine, prompt=ids, n=2, max_tokens=5, seed=7, logprobs=0, return_token_ids=True)
    for a, b in zip(as_text["choices"], as_ids["choices"]):
        assert (a["prompt_token_ids"], a["token_ids"], a["text"]) == (b["prompt_token_ids"], b["token_ids"], b["text"])
    one = _complete(engine, prompt=ids[0], max_tokens=5, seed=7, return_token_ids=True)
    assert one["choices"][0]["prompt_token_ids"] == ids[0]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "JSON object"),
        ({"prompt": "1+1=", "echo": True}, "unsupported field(s): echo"),
        ({"max_tokens": 4}, "'prompt' is required"),
        ({"prompt": []}, "'prompt' must be"),
        ({"prompt": [[1, -5, 6]]}, "'prompt' must be"),
        ({"prompt": ["1+1=", [1, 5]]}, "'prompt' must be"),
        ({"prompt": [1, 5, 999999]}, "past the model's vocabulary"),
        ({"prompt": "1+1=", "n": 0}, "n must be at least 1"),
        ({"prompt": "1+1=", "n": 1.5}, "'n' must be an integer"),
        ({"prompt": "1+1=", "temperature": -0.5}, "temperature must be >= 0"),
        ({"prompt": "1+1=", "top_p": 0}, "top_p must be in (0, 1]"),
        ({"prompt": "1+1=", "max_tokens": "4"}, "'max_tokens' must be an integer"),
        ({"prompt": "1+1=", "max_tokens": None}, "'max_tokens' must be an integer"),
        ({"prompt": "1+1=", "logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"prompt": "1+1=", "stop": [""]}, "stop strings must not be empty"),
        ({"prompt": "1+1=", "stop": 5}, "'stop' must be"),
        ({"prompt": "1+1=", "seed": True}, "'seed' must be an integer"),
        ({"prompt": "1+1=", "max_tokens": 64}, "maximum context length is 64 tokens"),
        ({"prompt": ["1+1=", "9" * 70], "max_tokens": 1}, "maximum context length is 64 tokens"),
    ],
    ids=lambda v: None if isinstance(v, str) else re.sub(r"\W+", "_", str(v))[:40],
)
def test_bad_requests_get_400_with_an_openai_error_body(engine, body, says):
    status, raw = _http(engine.url + "/v1/completions", "POST", body)
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert says in error["message"]


@pytest.mark.timeout(20)
def test_unknown_path_is_404_and_unknown_model_is_404_as_vllm_does(engine):
    status, raw = _http(engine.url + "/v1/chat/completions", "POST", {"messages": []})
    assert status == 404
    assert json.loads(raw)["error"]["code"] == 404
    status, raw = _http(engine.url + "/v1/completions", "POST", {"model": "other", "prompt": "1"})
    assert status == 404
    assert "`other` does not exist" in json.loads(raw)["error"]["message"]


@pytest.mark.timeout(20)
def test_one_connection_carries_many_requests_whatever_each_answered(engine):
    """HTTP/1.1 keep-alive: a rollout's client reuses its connections, so every request's body
    is read off the socket, a route that ignores it or one that refuses it included."""
    import http.client

    host, port = engine.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        requests = [("POST", "/v1/chat/completions", {"messages": []}, 404),
                    ("POST", "/health", {"x": 1}, 405),
                    ("POST", "/v1/completions", {"model": "other", "prompt": "1"}, 404),
                    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "3+3=", "max_tokens": 2}, 200),
                    ("GET", "/health", None, 200)]
        for method, path, body, status in requests:
            conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            assert (path, response.status) == (path, status)
            assert response.version == 11 and not response.will_close
        local = conn.sock.getsockname()
        conn.request("GET", "/health")
        conn.getresponse().read()
        assert conn.sock.getsockname() == local  # still the first connection
    finally:
        conn.close()


@pytest.mark.timeout(20)
def test_the_server_logs_one_line_per_request(engine):
    _http(engine.url + "/health")
    _complete(engine, prompt="3+3=", max_tokens=2)

    def logged(pattern):  # the line is written just after the response is sent
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in engine.log().splitlines()):
                return True
            time.sleep(0.02)
        return False

    assert logged(r"POST /v1/completions 200 .* prompts=1 n=1 max_tokens=2")
    assert logged(r"GET /health 200")


# --- sampling semantics ----------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_the_same_seed_gives_identical_texts_and_logprobs(client):
    kwargs = dict(n=3, temperature=1.0, max_tokens=12, seed=1234, logprobs=0)
    first = client.complete(PROMPTS, **kwargs)
    again = client.complete(PROMPTS, **kwargs)
    assert first == again


@pytest.mark.timeout(20)
def test_a_different_seed_gives_different_samples(client):
    kwargs = dict(n=2, temperature=1.0, max_tokens=12, logprobs=0)
    a = client.complete(PROMPTS, seed=1, **kwargs)
    b = client.complete(PROMPTS, seed=2, **kwargs)
    assert [[c.text for c in g] for g in a] != [[c.text for c in g] for g in b]
    # Unseeded requests draw fresh randomness too.
    c = client.complete(PROMPTS, **kwargs)
    d = client.complete(PROMPTS, **kwargs)
    assert c != d


@pytest.mark.timeout(20)
def test_greedy_is_deterministic_across_requests_and_samples(client):
    first = client.complete(PROMPTS, n=2, temperature=0, max_tokens=20, logprobs=0)
    again = client.complete(PROMPTS, n=2, temperature=0, max_tokens=20, logprobs=0, seed=99)
    assert first == again
    for a, b in first:
        # Batch rows may differ in the last float bits (kernel blocking), never in the choice.
        assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)


def _forward_logprobs(reference, prompt_ids: list[int], token_ids: list[int]):
    import torch

    m, _ = reference
    with torch.inference_mode():
        logits = m(input_ids=torch.tensor([prompt_ids + token_ids])).logits[0].float()
    # The distribution that produced generated token i sits at the position before it.
    return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : -1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_logprobs_are_those_of_the_raw_model_distribution(engine, reference, temperature, top_p):
    # Prompts of different lengths, so the batch is left-padded; n=2 exercises the repeated cache.
    body = _complete(
        engine, prompt=PROMPTS, n=2, temperature=temperature, top_p=top_p, max_tokens=30, seed=7, logprobs=3,
        return_token_ids=True,
    )
    checked = 0
    for c in body["choices"]:
        expected = _forward_logprobs(reference, c["prompt_token_ids"], c["token_ids"])
        got = c["logprobs"]["token_logprobs"]
        for i, token in enumerate(c["token_ids"]):
            assert got[i] == pytest.approx(expected[i, token].item(), abs=1e-4)
            top_values = expected[i].topk(3).values.tolist()
            listed = sorted(c["logprobs"]["top_logprobs"][i].values(), reverse=True)[:3]
            assert listed == pytest.approx(top_values, abs=1e-4)
            checked += 1
    assert checked > 30


@pytest.mark.timeout(20)
def test_a_stop_string_ends_the_sample_and_is_cut_from_the_text(engine, client, reference):
    _, tokenizer = reference
    greedy = [g[0] for g in client.complete(PROMPTS, temperature=0, max_tokens=30)]
    prompt, text = next((p, c.text) for p, c in zip(PROMPTS, greedy) if len(c.text) >= 6)
    for stop in (text[3], text[3:5]):
        body = _complete(
            engine, prompt=prompt, temperature=0, max_tokens=30, stop=["never", stop], return_token_ids=True
        )
        choice = body["choices"][0]
        assert choice["text"] == text[: text.index(stop)]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        # As in vLLM, the tokens that made the stop string are returned; nothing after them.
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == text[: text.index(stop) + len(stop)]


@pytest.mark.timeout(60)
def test_every_eos_id_of_the_generation_config_ends_a_sample(engine, model_dir, tmp_path):
    import shutil

    greedy = _complete(engine, prompt=PROMPTS[0], temperature=0, max_tokens=30, return_token_ids=True)["choices"][0]
    assert len(greedy["token_ids"]) >= 4
    extra_eos = greedy["token_ids"][2]  # a token greedy decoding reaches: an EOS id too, now
    first = greedy["token_ids"].index(extra_eos)
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [*(eos if isinstance(eos, list) else [eos]), extra_eos]}))
    other = Engine(copy, tmp_path / "engine.log")
    try:
        choice = _complete(other, prompt=PROMPTS[0], temperature=0, max_tokens=30, return_token_ids=True)["choices"][0]
    finally:
        other.kill()
    # As with the first EOS id: the sample stops there, the id is in the tokens, its text is not.
    assert choice["token_ids"] == greedy["token_ids"][: first + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert len(choice["text"]) < len(greedy["text"])


@pytest.mark.timeout(20)
def test_max_tokens_ends_a_sample_with_finish_reason_length(client):
    groups = client.complete(PROMPTS, n=4, temperature=1.0, max_tokens=3, seed=5, logprobs=0)
    completions = [c for g in groups for c in g]
    ran_out = [c for c in completions if c.tokens[-1] != "</s>"]
    assert ran_out, "some sample should not end in EOS within 3 tokens"
    for c in ran_out:
        assert (c.finish_reason, len(c.tokens)) == ("length", 3)
    for c in completions:
        if c.tokens[-1] == "</s>":  # EOS ends a sample, is in the tokens and not in the text
            assert c.finish_reason == "stop" and "</s>" not in c.text


# --- the client ------------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_client_groups_completions_per_prompt_in_prompt_order(client):
    together = client.complete(PROMPTS, n=2, temperature=0, max_tokens=10, logprobs=0, return_token_ids=True)
    assert len(together) == len(PROMPTS) and all(len(g) == 2 for g in together)
    for prompt, group in zip(PROMPTS, together):
        alone = client.complete([prompt], n=1, temperature=0, max_tokens=10, logprobs=0, return_token_ids=True)
        assert group[0].text == alone[0][0].text
        assert group[0].token_ids == alone[0][0].token_ids
        assert group[0].token_logprobs == pytest.approx(alone[0][0].token_logprobs, abs=1e-5)


@pytest.mark.timeout(20)
def test_client_raises_engine_error_with_the_server_message_on_400(client):
    with pytest.raises(EngineHTTPError) as raised:
        client.complete(["1+1="], n=0)
    assert raised.value.status == 400
    assert "n must be at least 1" in raised.value.server_message
    assert "/v1/completions" in str(raised.value) and "400" in str(raised.value)


@pytest.mark.timeout(20)
def test_client_health_and_wait_healthy_against_a_running_engine(client):
    assert client.health()
    client.wait_healthy(deadline_s=5)
    assert client.models() == [MODEL_NAME]


@pytest.mark.timeout(10)
def test_wait_healthy_fails_fast_when_nothing_listens():
    port = free_port()
    idle = EngineClient(f"http://127.0.0.1:{port}", timeout_s=5)
    assert not idle.health()
    started = time.monotonic()
    with pytest.raises(EngineUnavailable) as raised:
        idle.wait_healthy(deadline_s=0.5)
    assert time.monotonic() - started < 2.0
    message = str(raised.value)
    assert f"http://127.0.0.1:{port}/health" in message and "refused" in message.lower()
    with pytest.raises(EngineUnavailable, match="stopped waiting"):
        idle.wait_healthy(deadline_s=30, should_stop=lambda: True)
    with pytest.raises(EngineUnavailable, match="cannot reach"):
        idle.complete(["1+1="])


# --- lifecycle -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigterm_makes_the_server_exit_0_within_seconds_its_counters_logged_last(model_dir, tmp_path):
    e = Engine(model_dir, tmp_path / "engine.log")
    try:
        EngineClient(e.url, timeout_s=30).complete(["1+1="], n=3, max_tokens=2)
        os.kill(e.proc.pid, signal.SIGTERM)
        assert e.proc.wait(timeout=5) == 0, e.log()[-3000:]
        assert "SIGTERM received: shutting down" in e.log()
        last = e.log().strip().splitlines()[-1]
        stats = json.loads(last.split("stats at exit:", 1)[1])
        assert stats["requests"] == 1 and stats["prompt_tokens"] == 3 * stats["prefill_tokens"] > 0, last
        assert not EngineClient(e.url, timeout_s=2).health()
    finally:
        e.kill()


@pytest.mark.timeout(60)
def test_with_port_tries_a_port_taken_while_it_loaded_is_skipped_for_the_next_free_one(model_dir, tmp_path):
    """Two ranks of a node start their engines from the same port: the one that binds second
    takes the next free port (its port file says which) rather than failing."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        port_file = tmp_path / "engine.port"
        e = Engine(model_dir, tmp_path / "engine.log", ("--port", str(port), "--port-tries", "20", "--port-file", str(port_file)))
        try:
            deadline = time.monotonic() + 10  # written just after the "listening on" line
            while not port_file.is_file() and time.monotonic() < deadline:
                time.sleep(0.05)
            bound = int(port_file.read_text())
            assert port < bound < port + 20 and e.url.endswith(f":{bound}")
            assert f"port {port} is taken" in e.log()
        finally:
            e.kill()


def test_an_engine_that_cannot_load_its_model_writes_its_own_error_record(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": "not a number"}')
    error_file = tmp_path / "engine.error.json"
    result = subprocess.run([sys.executable, "-m", "orchestrator.engine.server", "--model", str(model), "--port", "0"],
                            capture_output=True, text=True, timeout=STARTUP_S,
                            env={**os.environ, "ORCHESTRATOR_ERROR_FILE": str(error_file)})
    assert result.returncode == 1, result.stderr[-3000:]
    record = child_error.read(error_file)
    assert record is not None and record["program"] == "engine" and record["exit_code"] == 1, result.stderr[-3000:]
    assert record["kind"] in result.stderr and "Traceback" in record["traceback"], record


# --- reload in place ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_reload_serves_the_new_weights_under_a_new_name_only_and_refuses_a_misfit(model_dir, tmp_path):
    """The in-place counterpart of a restart: same process and port, the other checkpoint's
    logprobs exactly as a fresh server on it gives them, and the old name is a 404."""
    from orchestrator.demo import model

    other = tmp_path / "other"
    model.save(model.create(1), other)
    body = {"prompt": ["12+34="], "n": 1, "temperature": 0, "max_tokens": 4, "logprobs": 0}
    fresh = Engine(other, tmp_path / "fresh.log")
    try:
        want = json.loads(_http(fresh.url + "/v1/completions", "POST", {"model": MODEL_NAME, **body})[1])["choices"][0]
    finally:
        fresh.kill()
    e = Engine(model_dir, tmp_path / "engine.log")
    try:
        before = _complete(e, **body)["choices"][0]
        assert before["logprobs"]["token_logprobs"] != want["logprobs"]["token_logprobs"]
        client = EngineClient(e.url, timeout_s=30, model=MODEL_NAME)
        assert client.reload(str(other), "policy-2") >= 0
        status, raw = _http(e.url + "/v1/completions", "POST", {"model": MODEL_NAME, **body})
        assert status == 404, raw
        after = json.loads(_http(e.url + "/v1/completions", "POST", {"model": "policy-2", **body})[1])["choices"][0]
        assert after["text"] == want["text"] and after["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
        assert client.models() == ["policy-2"] and e.proc.poll() is None
        assert re.search(r"reloaded \S+other in place in [0-9.]+s as 'policy-2' \(model.safetensors xxh3_128 [0-9a-f]{32}\)", e.log())

        misfit = tmp_path / "misfit"
        misfit.mkdir()
        import torch
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, misfit / "model.safetensors")
        with pytest.raises(EngineHTTPError) as refused:
            client.reload(str(misfit), "policy-3")
        assert refused.value.status == 400 and "shape (3, 3)" in str(refused.value)
        assert client.models() == ["policy-2"]  # the last good one serves on
        again = json.loads(_http(e.url + "/v1/completions", "POST", {"model": "policy-2", **body})[1])["choices"][0]
        assert again["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    finally:
        e.kill()


# --- batching across requests ------------------------------------------------------------------


@pytest.fixture(scope="module")
def endless_model_dir(model_dir, tmp_path_factory) -> Path:
    """The module's model with no EOS id: every sample runs to max_tokens, so that a request
    stays in the batch for a known number of steps."""
    import shutil

    directory = tmp_path_factory.mktemp("endless") / "model"
    shutil.copytree(model_dir, directory)
    config = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": []}))
    return directory


def _stats(engine: Engine) -> dict:
    status, raw = _http(engine.url + "/stats")
    assert status == 200, raw
    return json.loads(raw)


def _wait_for(engine: Engine, what: str, condition) -> None:
    deadline = time.monotonic() + 30
    while not condition(_stats(engine)):
        assert time.monotonic() < deadline, f"the engine never had {what}: {_stats(engine)}"
        time.sleep(0.005)


# A request that keeps the batch busy: 4 prompts x 8 samples x 56 tokens (the context is 64).
LONG = dict(prompt=PROMPTS[:4], n=8, temperature=1.0, max_tokens=56, seed=11, logprobs=0, return_token_ids=True)
SMALL = [
    dict(prompt=[PROMPTS[0]], n=1, temperature=0, max_tokens=20, logprobs=1, return_token_ids=True),
    dict(prompt=PROMPTS[1:3], n=2, temperature=1.0, max_tokens=12, seed=5, logprobs=0, return_token_ids=True),
    dict(prompt=[PROMPTS[3]], n=3, temperature=0.7, top_p=0.8, max_tokens=7, seed=6, logprobs=2, return_token_ids=True),
    dict(prompt=PROMPTS[2:], n=1, temperature=1.0, max_tokens=30, seed=7, return_token_ids=True),
    dict(prompt=[PROMPTS[4]], n=4, temperature=0, max_tokens=3, return_token_ids=True),
    dict(prompt=PROMPTS, n=2, temperature=1.2, max_tokens=16, seed=2**64 - 1, logprobs=0, return_token_ids=True),
]


def _assert_same_answer(got: dict, want: dict) -> None:
    assert len(got["choices"]) == len(want["choices"])
    for g, w in zip(got["choices"], want["choices"]):
        assert (g["text"], g["token_ids"], g["finish_reason"]) == (w["text"], w["token_ids"], w["finish_reason"])
        if w["logprobs"] is not None:
            # Batch shapes may move the last float bits of the logits, never the tokens drawn.
            assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-5)
            assert [list(t) for t in g["logprobs"]["top_logprobs"]] == [list(t) for t in w["logprobs"]["top_logprobs"]]
    assert got["usage"] == want["usage"]


@pytest.mark.timeout(120)
def test_concurrent_requests_join_the_running_batch_and_each_gets_what_it_gets_alone(endless_model_dir, tmp_path):
    """Greedy and seeded requests, sent while a long one decodes, all at once: each answer is
    the one the same request gets alone, and the server batched them with the long one."""
    from concurrent.futures import ThreadPoolExecutor

    e = Engine(endless_model_dir, tmp_path / "engine.log")
    try:
        alone = [_complete(e, **body) for body in [LONG, *SMALL]]
        before = _stats(e)
        with ThreadPoolExecutor(len(SMALL) + 1) as pool:
            long = pool.submit(_complete, e, **LONG)
            _wait_for(e, "the long request decoding", lambda s: s["running_requests"] >= 1)
            small = [pool.submit(_complete, e, **body) for body in SMALL]
            answers = [long.result(), *(f.result() for f in small)]
        after = _stats(e)
        deadline = time.monotonic() + 5  # each line is written just after its response is sent
        while len(lines := re.findall(r"POST /v1/completions 200 .* batch_requests=(\d+)", e.log())) < 2 * len(answers):
            assert time.monotonic() < deadline, lines
            time.sleep(0.02)
    finally:
        e.kill()
    for got, want in zip(answers, alone):
        _assert_same_answer(got, want)
    assert after["joined_running"] - before["joined_running"] >= 1, (before, after)
    assert after["peak_requests"] >= 2
    assert max(int(n) for n in lines[len(alone):]) >= 2, lines


@pytest.mark.timeout(120)
def test_a_reload_waits_for_the_requests_admitted_before_it_and_refuses_the_old_name_after(endless_model_dir, tmp_path):
    """A request running when /reload arrives finishes on the old weights; one queued behind
    the reload under the old name is refused with a 404; later ones get the new weights."""
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.demo import model

    other = tmp_path / "other"
    model.save(model.create(1), other)
    e = Engine(endless_model_dir, tmp_path / "engine.log")
    try:
        on_old_weights = _complete(e, **LONG)
        client = EngineClient(e.url, timeout_s=60, model=MODEL_NAME)
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(_complete, e, **LONG)
            _wait_for(e, "the long request decoding", lambda s: s["running_requests"] >= 1)
            reload = pool.submit(client.reload, str(other), "policy-2")
            _wait_for(e, "the reload queued", lambda s: s["waiting"] >= 1)
            late = pool.submit(_http, e.url + "/v1/completions", "POST", {"model": MODEL_NAME, **SMALL[0]})
            reload.result()
            # Every token of it on the old weights: a reload mid-request would change its logprobs.
            _assert_same_answer(running.result(), on_old_weights)
            status, raw = late.result()
        assert status == 404 and "does not exist" in json.loads(raw)["error"]["message"], raw
        on_new_weights = json.loads(_http(e.url + "/v1/completions", "POST", {"model": "policy-2", **LONG})[1])
        assert on_new_weights["choices"][0]["token_ids"] != on_old_weights["choices"][0]["token_ids"]
    finally:
        e.kill()


@pytest.mark.timeout(60)
def test_sigterm_with_a_request_decoding_exits_0_and_answers_it(endless_model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    e = Engine(endless_model_dir, tmp_path / "engine.log")
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_http, e.url + "/v1/completions", "POST",
                                  {"model": MODEL_NAME, **LONG, "prompt": PROMPTS * 20, "n": 16})
            _wait_for(e, "the request decoding", lambda s: s["running_requests"] >= 1)
            os.kill(e.proc.pid, signal.SIGTERM)
            assert e.proc.wait(timeout=5) == 0, e.log()[-3000:]
            try:
                status, raw = running.result(timeout=10)
            except (urllib.error.URLError, ConnectionError):
                pass  # the process may exit before the answer is written: the client sees the connection drop
            else:
                assert status == 503 and "shutting down" in json.loads(raw)["error"]["message"], raw
        assert "SIGTERM received: shutting down" in e.log()
    finally:
        e.kill()


BIG = {**LONG, "prompt": PROMPTS[:4] * 8}
"""LONG over 256 sequences: some half a second of steps, which a pause comes well inside."""


@pytest.mark.timeout(120)
def test_a_pause_answers_what_runs_with_what_it_sampled_holds_new_requests_and_a_resume_serves_them(endless_model_dir, tmp_path):
    """vLLM's /pause and /resume: the running request comes back at once, each sample with the
    tokens it had (a prefix of what it samples unpaused, the same log-probs), finish reason
    abort; a request sent while paused waits for the resume and is then served whole; with
    wait_for_inflight_requests the running request finishes first."""
    from concurrent.futures import ThreadPoolExecutor

    e = Engine(endless_model_dir, tmp_path / "engine.log")
    client = EngineClient(e.url, timeout_s=60, model=MODEL_NAME)
    try:
        whole = _complete(e, **BIG)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(_complete, e, **BIG)
            _wait_for(e, "the long request some steps in", lambda s: s["running_requests"] >= 1 and s["steps"] >= 5 + 56)
            client.pause()
            cut = running.result(timeout=5)  # answered by the pause, not after its 56 tokens
            assert client.is_paused() and _stats(e)["paused"] and _stats(e)["aborted"] == 1
            assert [c["finish_reason"] for c in cut["choices"]] == ["abort"] * len(whole["choices"])
            for got, want in zip(cut["choices"], whole["choices"]):
                k = len(got["token_ids"])
                assert 0 < k < BIG["max_tokens"] and got["token_ids"] == want["token_ids"][:k]
                assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"][:k], abs=1e-5)
            assert cut["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in cut["choices"])

            held = pool.submit(_complete, e, **SMALL[0])
            _wait_for(e, "the new request held by the pause", lambda s: s["waiting"] >= 1)
            assert not held.done() and _stats(e)["running_requests"] == 0
            client.resume()
            assert not client.is_paused()
            served = held.result(timeout=30)
        assert served["choices"][0]["finish_reason"] == "length" and len(served["choices"][0]["token_ids"]) == SMALL[0]["max_tokens"]

        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_complete, e, **BIG)
            _wait_for(e, "the long request decoding", lambda s: s["running_requests"] >= 1)
            client.pause(wait_for_inflight_requests=True)
            assert _stats(e)["running_requests"] == 0 and _stats(e)["aborted"] == 1  # it ran to its end before the pause
            _assert_same_answer(running.result(timeout=30), whole)
        client.resume()
    finally:
        e.kill()
