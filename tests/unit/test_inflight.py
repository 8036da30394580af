"""The rollout's requests in flight (workloads/rl/engine_requests.py) against engines faked at the one
seam it calls, ``acomplete``; tests/system/test_rollout_inflight.py runs a real engine process."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from orchestrator.engine.client import Completion, EngineHTTPError
from orchestrator.runtime.context import SerialPipe
from orchestrator.runtime.phases.rollout import _settled
from orchestrator.workloads.rl.engine_requests import Inflight, Request
from tests import http_stub

pytestmark = pytest.mark.timeout(30)


class FakeEngine:
    def __init__(self, delay_s: float = 0.02, fail_on: str | None = None):
        self.delay_s, self.fail_on = delay_s, fail_on
        self.in_flight = self.peak = 0
        self.prompts: list[str] = []

    def async_http(self, timeout_s=None, **kwargs) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    async def acomplete(self, http, prompts, *, n=1, seed=None, **_):
        self.in_flight += len(prompts) * n
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail_on in prompts:
                raise EngineHTTPError("POST /v1/completions", 400, "too long")
            self.prompts.extend(prompts)
            return [[Completion(p, "stop", None, None)] * n for p in prompts]
        finally:
            self.in_flight -= len(prompts) * n


def _requests(count: int, size: int = 1) -> list[Request]:
    return [Request([f"t{i}-{j}" for j in range(size)], [f"p{i}-{j}" for j in range(size)], seed=i) for i in range(count)]


def _drain(inflight: Inflight, count: int) -> list:
    got = []
    while len(got) < count:
        got.extend(inflight.answers(timeout_s=5))
    return got


def test_an_engine_holds_exactly_max_sequences_while_there_is_work():
    engine = FakeEngine()
    inflight = Inflight([engine], max_sequences=32, sampling={"n": 8}, timeout_s=10)
    try:
        inflight.submit(_requests(40))
        answers = _drain(inflight, 40)
    finally:
        inflight.close()
    assert engine.peak == 32 and inflight.stats.peak_sequences == [32]
    assert sorted(a.request.task_ids[0] for a in answers) == sorted(f"t{i}-0" for i in range(40))
    assert inflight.queued_sequences == 0


def test_the_least_loaded_engine_takes_the_next_request_and_a_request_over_the_budget_goes_alone():
    engines = [FakeEngine(), FakeEngine()]
    inflight = Inflight(engines, max_sequences=8, sampling={"n": 4}, timeout_s=10)
    try:
        inflight.submit(_requests(8) + _requests(1, size=3))  # 12 sequences: more than one engine's 8
        _drain(inflight, 9)
    finally:
        inflight.close()
    assert len(engines[0].prompts) + len(engines[1].prompts) == 11
    assert min(len(e.prompts) for e in engines) >= 3  # both were used
    assert max(e.peak for e in engines) == 12  # the big request alone, never beside another


def test_a_failed_request_is_raised_in_the_callers_thread_and_nothing_more_is_sent():
    engine = FakeEngine(fail_on="p3-0")
    inflight = Inflight([engine], max_sequences=2, sampling={"n": 1}, timeout_s=10)
    try:
        inflight.submit(_requests(20))
        with pytest.raises(EngineHTTPError, match="too long"):
            _drain(inflight, 20)
    finally:
        inflight.close()
    assert len(engine.prompts) < 19


def test_a_serial_pipe_takes_one_chunk_at_a_time():
    pipe = SerialPipe(lambda ids: iter([ids[:2], ids[2:]]))
    assert pipe.wants_more()
    pipe.submit(["a", "b", "c"])
    assert not pipe.wants_more() and pipe.outstanding == 3
    assert pipe.next_batch(0.1) == ["a", "b"] and pipe.outstanding == 1
    assert pipe.next_batch(0.1) == ["c"] and pipe.outstanding == 0 and pipe.wants_more()


def test_a_chunk_is_settled_when_its_last_submitted_task_is_durable():
    unfinished = {0: {"a", "b"}, 1: {"c"}}
    assert _settled(unfinished, [{"task_id": "a"}, {"task_id": "c"}]) == {1}
    assert _settled(unfinished, [{"task_id": "b"}]) == {0}
    assert unfinished == {}


def test_a_request_carries_one_prompt_to_vllm_and_about_128_sequences_to_the_embedded_engine():
    from orchestrator.workloads.rl.workload import prompts_per_request

    assert [prompts_per_request("vllm", n) for n in (1, 8, 64)] == [1, 1, 1]  # one seed a request: one prompt
    assert [prompts_per_request("embedded", n) for n in (1, 8, 16, 200)] == [128, 16, 8, 1]


def _answer(n: int) -> dict:
    return {"choices": [{"index": i, "text": "4", "finish_reason": "stop", "logprobs": None} for i in range(n)]}


def _complete_on(behave, timeout_s: float = 5):
    from orchestrator.engine.client import EngineClient

    async def go():
        server = await http_stub.serve(behave)
        client = EngineClient(http_stub.url(server), timeout_s, model="m")
        try:
            async with client.async_http() as http:
                return await client.acomplete(http, ["2+2="], n=2, seed=7)
        finally:
            server.close()
    return asyncio.run(go())


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_request_whose_connection_closed_under_it_is_sent_once_more(reset):
    from orchestrator.engine.client import EngineUnavailable

    sent = []

    async def once(body, writer):
        sent.append(body)
        return http_stub.close(writer, reset) if len(sent) == 1 else http_stub.reply(writer, _answer(2))

    groups = _complete_on(once)
    assert [c.text for c in groups[0]] == ["4", "4"] and len(sent) == 2
    assert sent[0] == sent[1]  # the same request, its seed included

    sent.clear()

    async def always(body, writer):
        sent.append(body)
        return http_stub.close(writer, reset)

    with pytest.raises(EngineUnavailable, match="twice"):
        _complete_on(always)
    assert len(sent) == 2

    sent.clear()

    async def hold(body, writer):
        sent.append(body)
        await asyncio.sleep(30)

    with pytest.raises(EngineUnavailable):
        _complete_on(hold, timeout_s=0.5)
    assert len(sent) == 1  # a timed-out request may still be running: not sent again


def test_a_refused_request_is_not_sent_again():
    from orchestrator.engine.client import EngineClient, EngineUnavailable
    from tests.harness import free_port

    async def go():
        client = EngineClient(f"http://127.0.0.1:{free_port()}", 5, model="m")  # nothing listens there
        async with client.async_http() as http:
            return await client.acomplete(http, ["2+2="])

    with pytest.raises(EngineUnavailable, match="Cannot connect") as refused:
        asyncio.run(go())
    assert "twice" not in str(refused.value)


class PausingEngine(FakeEngine):
    """An engine that pauses as vLLM's does: what it samples comes back at once with finish
    reason abort; a request that reaches it while paused waits for the resume. ``transit_s``:
    how long each prompt's request takes to reach it."""

    def __init__(self, delay_s: float, transit_s: dict[str, float]):
        super().__init__(delay_s)
        self.transit_s, self.calls, self.arrived = transit_s, [], []
        self.paused = False

    def pause(self):
        self.calls.append("pause")
        self.paused = True

    def resume(self):
        self.calls.append("resume")
        self.paused = False

    async def acomplete(self, http, prompts, *, n=1, **_):
        await asyncio.sleep(max(self.transit_s.get(p, 0.0) for p in prompts))
        self.arrived.extend(prompts)
        while self.paused:  # reached it paused: held until the resume
            await asyncio.sleep(0.01)
        began = asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - began < self.delay_s:
            if self.paused:
                return [[Completion(p, "abort", None, None)] * n for p in prompts]
            await asyncio.sleep(0.01)
        return [[Completion(p, "stop", None, None)] * n for p in prompts]


def test_a_stop_answers_what_the_engine_was_sampling_and_returns_the_unsent_and_the_held_requests():
    engine = PausingEngine(delay_s=30, transit_s={"p1-0": 1.0})  # p1 reaches the engine after the pause
    inflight = Inflight([engine], max_sequences=2, sampling={"n": 1}, timeout_s=60)
    try:
        inflight.submit(_requests(3))  # p0 and p1 sent, p2 waits for room
        deadline = time.monotonic() + 10
        while "p0-0" not in engine.arrived:  # p0 is being sampled
            assert time.monotonic() < deadline, "p0 never reached the engine"
            time.sleep(0.01)
        unsent = inflight.stop(timeout_s=10)
        answers = inflight.answers(timeout_s=0)
    finally:
        inflight.close()
    assert engine.calls == ["pause", "resume"]
    assert sorted(r.task_ids[0] for r in unsent) == ["t1-0", "t2-0"]  # held (withdrawn), and never sent
    assert [(a.request.task_ids[0], a.groups[0][0].finish_reason) for a in answers] == [("t0-0", "abort")]
    assert inflight.queued_sequences == 0


class GoneEngine(FakeEngine):
    """An engine of another node that stopped answering: refused, as a dead node's port is."""

    def __init__(self, url: str, answers: int = 0):
        super().__init__()
        self.base_url, self.answers = url, answers

    async def acomplete(self, http, prompts, *, n=1, seed=None, **kw):
        if self.answers <= 0:
            from orchestrator.engine.client import EngineUnavailable

            raise EngineUnavailable(f"cannot reach the engine at POST {self.base_url}/v1/completions: ConnectError")
        self.answers -= 1
        return await super().acomplete(http, prompts, n=n, seed=seed, **kw)


def test_failing_over_an_engine_that_stops_answering_sends_its_requests_to_the_others_until_none_is_left():
    from orchestrator.workloads.rl.engine_requests import EnginesGone

    gone, alive = GoneEngine("http://10.0.0.2:8000", answers=3), FakeEngine()
    alive.base_url = "http://10.0.0.3:8000"
    told = []
    inflight = Inflight([gone, alive], max_sequences=4, sampling={"n": 1}, timeout_s=10, failover=told.append, label="models.judge")
    try:
        inflight.submit(_requests(40))
        answers = _drain(inflight, 40)  # every request answered: those that failed went to the other engine
    finally:
        inflight.close()
    assert sorted(a.request.seed for a in answers) == list(range(40))
    assert len(gone.prompts) == 3 and len(alive.prompts) == 37 and not told
    # Without another engine the request fails naming the model, once the caller was told (its wait for a verdict).
    inflight = Inflight([GoneEngine("http://10.0.0.2:8000")], max_sequences=4, sampling={"n": 1}, timeout_s=10, failover=told.append,
                        label="models.judge")
    try:
        inflight.submit(_requests(2))
        with pytest.raises(EnginesGone, match=r"every engine of models.judge stopped answering \(http://10.0.0.2:8000\)"):
            _drain(inflight, 2)
    finally:
        inflight.close()
    assert len(told) == 1

    def verdict(_error):  # the wait learnt that the serving node died: that is the failure
        raise RuntimeError("rank 1 on host n1 died")

    inflight = Inflight([GoneEngine("http://10.0.0.2:8000")], max_sequences=4, sampling={"n": 1}, timeout_s=10, failover=verdict)
    try:
        inflight.submit(_requests(2))
        with pytest.raises(RuntimeError, match="rank 1 on host n1 died"):
            _drain(inflight, 2)
    finally:
        inflight.close()
    # Without failover (the policy's own engines), the first failure fails the request.
    inflight = Inflight([GoneEngine("http://10.0.0.2:8000"), alive], max_sequences=4, sampling={"n": 1}, timeout_s=10)
    try:
        inflight.submit(_requests(1))
        with pytest.raises(Exception, match="cannot reach the engine"):
            _drain(inflight, 1)
    finally:
        inflight.close()
