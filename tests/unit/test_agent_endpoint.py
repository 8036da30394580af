"""The agent endpoint (agents/endpoint.py, sessions.py, runner.py) with the real openai client
over real HTTP, in front of a scripted engine: an agent's tool-calling loop recorded
token-exact, what the record holds, and the calls and agents that are refused or fail."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

openai = pytest.importorskip("openai")

from orchestrator.agents.endpoint import AgentEndpoint  # noqa: E402
from orchestrator.agents.runner import Agents  # noqa: E402
from orchestrator.data import turns  # noqa: E402
from orchestrator.engine.client import Completion  # noqa: E402
from orchestrator.plugins import rewards  # noqa: E402
from orchestrator.workloads.rl.engine_requests import Answer, Stopped  # noqa: E402

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
TASK = {"id": "t1", "prompt": [{"role": "user", "content": "What is 2*3?"}], "answer": "6"}


@pytest.fixture(scope="module")
def tokenizer():
    from orchestrator.demo import chat_tokenizer, tasks, warm_start

    return chat_tokenizer.fast(chat_tokenizer.corpus(tasks.make_tasks(0, chat=True)["train"][:200], warm_start.CHAT.target))


class Engine:
    """Answers a sample's k-th call with ``replies[k]`` (its ids, then EOS); keeps the requests."""

    capacity = 64
    """Sequences in flight at once (Inflight.capacity): as many agents run at once."""

    def __init__(self, tokenizer, replies, by_call=False):
        self.tokenizer, self.replies, self.by_call, self.requests = tokenizer, replies, by_call, []

    def ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    async def complete(self, request):
        self.requests.append(request)
        turn = self.tokenizer.decode(request.prompts[0]).count("<|im_start|>assistant") - 1  # the model's turns so far
        if self.by_call:  # the k-th request overall (one sample)
            turn = len(self.requests) - 1
        text = self.replies[min(turn, len(self.replies) - 1)]
        ids = self.ids(text)
        return Answer(request, [[Completion(text, "stop", [-0.5] * len(ids), None, ids, request.prompts[0])]], 0.0, 0.0)


async def calculator_agent(task, base_url):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = list(task["prompt"])
    for _ in range(3):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0]
        messages.append(reply.message.model_dump())  # sent back as the client got it
        if reply.finish_reason != "tool_calls":
            return reply.message.content
        for call in reply.message.tool_calls:
            result = str(eval(json.loads(call.function.arguments)["expression"]))  # noqa: S307 - the test's own arithmetic
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def run(tokenizer, agent, replies=(CALL, "\\boxed{6}"), *, n=2, timeout_s=5.0, max_tokens=200, context=None, by_call=False):
    engine = Engine(tokenizer, list(replies), by_call)
    endpoint = AgentEndpoint(tokenizer, tool_parser="hermes", max_tokens=max_tokens, context=context)
    agents = Agents(agent, "rl.agent=my:agent", endpoint, rewards.math, timeout_s)

    async def main():
        try:
            return await agents.run(engine, TASK, n=n, seed="s")
        finally:
            await endpoint.stop()

    try:
        prompt, prompt_ids, samples, _ = asyncio.run(main())
    finally:
        agents.threads.close()
    return prompt_ids, samples, engine, endpoint


def test_a_tool_calling_agent_is_recorded_token_exact_with_the_tools_answer_as_context(tokenizer):
    prompt_ids, samples, engine, _ = run(tokenizer, calculator_agent)
    assert prompt_ids == turns.render(tokenizer, TASK["prompt"], generation_prompt=True, tools=TOOLS)
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>system\nTools: calc(expression)<|im_end|>"), "the template renders tools"
    call, answer = engine.ids(CALL), engine.ids("\\boxed{6}")
    obs = turns.observation_ids(tokenizer, [{"role": "tool", "content": "6", "tool_call_id": "x"}], TOOLS)
    assert len(engine.requests) == 4 and all(r.n == 1 for r in engine.requests)
    assert engine.requests[-1].prompts[0] in (prompt_ids + call + obs,), "the second call extends the first: ids as sampled"
    for s in samples:
        assert s["token_ids"] == call + obs + answer and "reward_error" not in s, s.get("reward_error")
        assert s["loss_mask"] == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
        assert s["logprobs"] == [-0.5] * len(call) + [0.0] * len(obs) + [-0.5] * len(answer)
        assert s["reward"] == 1.0 and len(s["turns"]) == 2 and s["turns"][0]["text"] == CALL
        assert s["turns"][0]["observation"][0]["content"] == "6" and "segments" not in s
    assert len({r.seed for r in engine.requests}) == 4, "each call of each sample has a seed of its own"


def test_the_tool_demos_example_agent_calls_the_calculator_and_answers(tokenizer):
    """examples/agents/calculator_agent.py: the model's hermes call answered by calc, its boxed
    number returned for the math reward; a boxed expression is no answer."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "agents" / "calculator_agent.py"
    spec = importlib.util.spec_from_file_location("calculator_agent", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    prompt_ids, samples, engine, _ = run(tokenizer, example.solve)
    assert prompt_ids == turns.render(tokenizer, TASK["prompt"], generation_prompt=True, tools=[example.CALC_TOOL])
    obs = turns.observation_ids(tokenizer, [{"role": "tool", "content": "6"}], [example.CALC_TOOL])
    assert all(s["reward"] == 1.0 and s["token_ids"] == engine.ids(CALL) + obs + engine.ids("\\boxed{6}") for s in samples)
    _, samples, _, _ = run(tokenizer, example.solve, replies=(CALL, "\\boxed{2*3}"))
    assert all(s["reward"] == 0.0 and "reward_error" not in s for s in samples)
    malformed = CALL.replace("}}", "}")  # the model's JSON does not parse: plain content, the agent's to judge
    _, samples, engine, _ = run(tokenizer, example.solve, replies=(malformed,))
    assert len(engine.requests) == 2 and all(
        s["reward"] == 0.0 and "reward_error" not in s and s["turns"][0]["text"] == malformed and s["token_ids"] == engine.ids(malformed)
        for s in samples)


def test_an_agent_that_rewrites_its_history_starts_a_new_segment(tokenizer):
    async def forgetful(task, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        first = await client.chat.completions.create(model="policy", messages=task["prompt"], tools=TOOLS)
        assert first.choices[0].finish_reason == "tool_calls"
        again = [{"role": "user", "content": "What is 2*3? It is 6."}]  # the history summarised, not extended
        return (await client.chat.completions.create(model="policy", messages=again)).choices[0].message.content

    _, samples, engine, _ = run(tokenizer, forgetful, n=1, by_call=True)
    (s,) = samples
    assert s["reward"] == 1.0 and [len(seg["turns"]) for seg in s["segments"]] == [1]
    assert s["segments"][0]["token_ids"] == engine.ids(CALL)
    assert engine.requests[1].prompts[0] == turns.render(tokenizer, [{"role": "user", "content": "What is 2*3? It is 6."}], True)


def test_replies_rewards_and_failures_of_agents(tokenizer):
    def sync_agent(task, base_url):  # a plain function runs on a worker thread
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=task["prompt"])
        return {"reward": 0.5, "metrics": {"calls": 1}} if reply.choices[0].message.content else 0.0

    _, samples, _, _ = run(tokenizer, sync_agent, replies=["\\boxed{6}"])
    assert all(s["reward"] == 0.5 and s["metrics"] == {"calls": 1.0} for s in samples)

    async def raises(task, base_url):
        raise RuntimeError("agent bug")

    async def hangs(task, base_url):
        await asyncio.sleep(60)

    async def wrong(task, base_url):
        return [1]

    for agent, error in ((raises, "RuntimeError: agent bug"), (hangs, "took longer than rl.env_timeout_s=0.5"),
                         (wrong, "the agent returned [1]")):
        began = time.monotonic()
        _, samples, _, _ = run(tokenizer, agent, timeout_s=0.5)
        assert time.monotonic() - began < 5
        assert all(s["reward"] == 0.0 and error in s["reward_error"] and s["token_ids"] == [] for s in samples), samples[0]


def test_as_many_agents_run_at_once_as_the_engines_hold_sequences_and_a_waiting_ones_time_does_not_run(tokenizer, monkeypatch):
    """The others wait to start: their rl.env_timeout_s counts from their start, so an agent that
    waited longer than it for a slot is not timed out."""
    running, most = [], []
    from orchestrator.agents.clients import client

    async def slow(task, base_url):
        running.append(base_url)
        most.append(len(running))
        await asyncio.sleep(0.4)
        reply = await client(base_url).chat.completions.create(model="policy", messages=task["prompt"])
        running.remove(base_url)
        return reply.choices[0].message.content

    monkeypatch.setattr(Engine, "capacity", 2)
    _, samples, _, _ = run(tokenizer, slow, replies=["\\boxed{6}"], n=6, timeout_s=0.7)
    assert max(most) == 2 and len(most) == 6
    assert all(s["reward"] == 1.0 and "reward_error" not in s for s in samples), samples[0]


def test_the_helpers_client_calls_its_own_rollouts_endpoint_in_process_and_any_other_over_http(tokenizer):
    """agents/clients.py: an agent of the rollout reaches the endpoint's app on the rollout's loop,
    no sockets; a base URL that no endpoint of this loop serves goes over HTTP as given."""
    import httpx

    from orchestrator.agents.clients import client

    seen = {}

    async def agent(task, base_url):
        own = client(base_url)
        seen["own"] = own._client._transport
        seen["other"] = client("http://127.0.0.1:9/v1")._client._transport
        reply = await own.chat.completions.create(model="policy", messages=task["prompt"])
        return reply.choices[0].message.content

    _, samples, _, _ = run(tokenizer, agent, replies=["\\boxed{6}"])
    assert isinstance(seen["own"], httpx.ASGITransport) and not isinstance(seen["other"], httpx.ASGITransport)
    assert all(s["reward"] == 1.0 and "reward_error" not in s for s in samples), samples[0]


def test_a_streamed_call_is_its_whole_reply_in_one_chunk_then_done(tokenizer):
    """As verifiers' interception server and streaming agents call: the openai client's stream
    gives the message (tool calls included), the usage when asked for, and ends."""
    seen = {}

    async def streaming(task, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = list(task["prompt"])
        for _ in range(3):
            chunks = [c async for c in await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True})]
            [reply] = [c for c in chunks if c.choices]
            seen.setdefault("usage", [c.usage for c in chunks if c.usage])
            choice = reply.choices[0]
            if choice.finish_reason != "tool_calls":
                return choice.delta.content
            calls = [{"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}}
                     for t in choice.delta.tool_calls]
            messages.append({"role": "assistant", "content": choice.delta.content, "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "6"} for c in calls]
        return ""

    prompt_ids, samples, engine, _ = run(tokenizer, streaming)
    obs = turns.observation_ids(tokenizer, [{"role": "tool", "content": "6"}], TOOLS)
    assert all(s["reward"] == 1.0 and s["token_ids"] == engine.ids(CALL) + obs + engine.ids("\\boxed{6}") for s in samples)
    [usage] = seen["usage"]
    assert usage.prompt_tokens == len(prompt_ids) and usage.completion_tokens == len(engine.ids(CALL))


def test_calls_that_are_refused(tokenizer):
    kept = {}

    async def probe(task, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        kept["url"] = base_url
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            await client.chat.completions.create(model="policy", messages=task["prompt"], n=2)
        with pytest.raises(openai.NotFoundError, match="the model is 'policy'"):
            await client.chat.completions.create(model="gpt-4o", messages=task["prompt"])
        unknown = openai.AsyncOpenAI(base_url=base_url.rsplit("/sessions/", 1)[0] + "/sessions/nobody/v1", api_key="none",
                                     max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no session 'nobody'"):
            await unknown.chat.completions.create(model="policy", messages=task["prompt"])
        assert [m.id for m in (await client.models.list()).data] == ["policy"]
        streamed = [c async for c in await client.completions.create(model="policy", prompt="2*3=", stream=True)]
        assert len(streamed) == 1 and streamed[0].choices[0].finish_reason == "stop" and streamed[0].choices[0].text
        return 1.0

    _, samples, _, endpoint = run(tokenizer, probe, n=1)
    assert samples[0]["reward"] == 1.0 and "reward_error" not in samples[0], samples[0].get("reward_error")

    # a call after the agent returned: 409, before the rollout forgets the session and after
    async def late():
        await endpoint.start(Engine(tokenizer, ["x"]))
        session, url = endpoint.open(TASK, "late")
        endpoint.close(session)
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
        try:
            with pytest.raises(openai.ConflictError, match="its agent already returned"):
                await client.chat.completions.create(model="policy", messages=TASK["prompt"])
            endpoint.forget(session)
            with pytest.raises(openai.ConflictError, match="its agent already returned"):
                await client.chat.completions.create(model="policy", messages=TASK["prompt"])
        finally:
            await endpoint.stop()

    asyncio.run(late())


def test_the_completions_route_extends_a_text_or_ids_prompt_token_exact(tokenizer):
    async def writer(task, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        prompt = "Q: 2*3?\nA:"
        first = (await client.completions.create(model="policy", prompt=prompt)).choices[0]
        prompt += first.text + "\nCheck:"  # extends what was sent and sampled: the same ids, then the new text's
        second = (await client.completions.create(model="policy", prompt=prompt)).choices[0]
        return second.text

    _, samples, engine, _ = run(tokenizer, writer, replies=["\\boxed{5}", "\\boxed{6}"], n=1, by_call=True)
    (s,) = samples
    first, second = engine.ids("\\boxed{5}"), engine.ids("\\boxed{6}")
    check = tokenizer("\nCheck:", add_special_tokens=False)["input_ids"]
    prompt = tokenizer("Q: 2*3?\nA:")["input_ids"]
    assert engine.requests[1].prompts[0] == prompt + first + check
    assert s["token_ids"] == first + check + second and s["loss_mask"] == [1] * len(first) + [0] * len(check) + [1] * len(second)
    assert s["reward"] == 1.0 and "segments" not in s


class Stopping(Engine):
    """The first call as :class:`Engine` answers it; at the second the rollout's stop begins
    (``agents.stopping``): the reply stopped part-way (``\\box``, finish reason abort), never sent
    (Stopped), or, ``how`` "other", stopped by another rank's stop of a shared engine."""

    def __init__(self, tokenizer, how):
        super().__init__(tokenizer, [CALL, "\\boxed{6}"])
        self.how, self.agents = how, None

    async def complete(self, request):
        if not self.requests or len(self.requests) > 1 and self.how == "other":
            return await super().complete(request)
        self.requests.append(request)
        self.agents.stopping = self.how != "other"
        if self.how == "unsent":
            raise Stopped()
        ids = self.tokenizer("\\box", add_special_tokens=False)["input_ids"]
        return Answer(request, [[Completion("\\box", "abort", [-0.25] * len(ids), None, ids, request.prompts[0])]], 0.0, 0.0)


def calculator(seen: list, *, sync: bool = False, stop_in_tool=None, answer=lambda: "6"):
    """The calculator agent; ``seen`` gets each tool call's id; ``stop_in_tool()`` runs in its tool."""
    def tool(call, messages):
        seen.append(call.id)
        if stop_in_tool is not None:
            stop_in_tool()
        messages.append({"role": "tool", "tool_call_id": call.id, "content": answer()})

    if sync:
        def agent(task, base_url):
            client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
            messages = list(task["prompt"])
            for _ in range(3):
                reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
                messages.append(reply.message.model_dump())
                if reply.finish_reason != "tool_calls":
                    return reply.message.content
                for call in reply.message.tool_calls:
                    tool(call, messages)
            return ""
        return agent

    async def agent(task, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = list(task["prompt"])
        for _ in range(3):
            reply = (await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)).choices[0]
            messages.append(reply.message.model_dump())
            if reply.finish_reason != "tool_calls":
                return reply.message.content
            for call in reply.message.tool_calls:
                tool(call, messages)
        return ""
    return agent


def _agents(tokenizer, agent, engine):
    endpoint = AgentEndpoint(tokenizer, tool_parser="hermes", max_tokens=200, context=None)
    return Agents(agent, "rl.agent=my:agent", endpoint, rewards.math, 5.0)


def _through(agents, coroutine):
    async def main():
        try:
            return await coroutine
        finally:
            await agents.endpoint.stop()

    try:
        return asyncio.run(main())
    finally:
        agents.threads.close()


@pytest.mark.parametrize("how", ["in-its-call", "in-its-call-thread", "unsent", "in-its-tool"])
def test_a_stopped_agent_sample_is_carried_and_its_agent_run_again_is_answered_from_the_record(tokenizer, how):
    """rollout.partial: the stop ends a sample at its call: a reply being sampled keeps what it
    had, a call not sent (or made while its tool ran) is recorded unsampled; the agent is
    cancelled or told 409. Continued, the agent runs again: its first call is answered from the
    record without the engine, with the same tool call id; the stopped call goes on from its ids
    (or is sampled now), and the sample ends as if never stopped."""
    seen = []
    engine = Stopping(tokenizer, "unsent" if how == "in-its-tool" else how.removesuffix("-thread"))
    agents = engine.agents = _agents(tokenizer, None, engine)
    stop_in_tool = (lambda: setattr(agents, "stopping", True)) if how == "in-its-tool" else None
    agents.agent = calculator(seen, sync=how.endswith("thread"), stop_in_tool=stop_in_tool)
    _text, prompt_ids, [cut], _ = _through(agents, agents.run(engine, TASK, n=1, seed="s"))
    assert cut["finish_reason"] == "abort" and "reward" not in cut and "reward_error" not in cut, cut.get("reward_error")
    call = engine.ids(CALL)
    obs = turns.observation_ids(tokenizer, [{"role": "tool", "content": "6"}], TOOLS)
    if how.startswith("in-its-call"):
        assert [t["text"] for t in cut["turns"]] == [CALL, "\\box"] and cut["turns"][1]["finish_reason"] == "abort"
    else:
        assert [t["text"] for t in cut["turns"]] == [CALL] and cut["turns"][0]["observation"][0]["content"] == "6"
        assert cut["token_ids"] == call + obs, "the call made at the stop: its messages recorded, not sampled"
    assert len(engine.requests) == (1 if how == "in-its-tool" else 2)

    class Rest(Engine):
        async def complete(self, request):  # the stopped reply's rest, or the answer
            self.replies = ["ed{6}" if how.startswith("in-its-call") else "\\boxed{6}"]
            return await super().complete(request)

    again = Rest(tokenizer, [])
    agents = _agents(tokenizer, calculator(seen, sync=how.endswith("thread")), again)
    _text, ids, [done], _ = _through(agents, agents.resume(again, TASK, {"prompt_token_ids": prompt_ids, "samples": [cut]}, seed="s2"))
    assert ids == prompt_ids and done["finish_reason"] == "stop" and "reward_error" not in done, done.get("reward_error")
    assert done["reward"] == 1.0 and len(done["turns"]) == 2 and done["turns"][1]["text"] == "\\boxed{6}"
    assert len(again.requests) == 1, "the first call answered from the record"
    assert again.requests[0].prompts[0] == prompt_ids + cut["token_ids"], "it goes on from the ids it had"
    n = len(cut["token_ids"])
    assert done["token_ids"][:n] == cut["token_ids"] and done["logprobs"][:n] == cut["logprobs"] and done["loss_mask"][:n] == cut["loss_mask"]
    assert len(seen) == 2 and seen[0] == seen[1], "the replayed reply's tool call has the id it had"


def test_an_agent_that_makes_another_call_when_run_again_fails_its_carried_sample(tokenizer):
    answers = iter(["6", "7"])
    engine = Stopping(tokenizer, "in-its-call")
    agents = engine.agents = _agents(tokenizer, calculator([], answer=lambda: next(answers)), engine)
    _text, prompt_ids, [cut], _ = _through(agents, agents.run(engine, TASK, n=1, seed="s"))
    again = Engine(tokenizer, [CALL, "\\boxed{6}"])
    agents = _agents(tokenizer, calculator([], answer=lambda: next(answers)), again)
    _t, _ids, [done], _ = _through(agents, agents.resume(again, TASK, {"prompt_token_ids": prompt_ids, "samples": [cut]}, seed="s2"))
    assert done["reward"] == 0.0 and "call 2 of a sample carried by rollout.partial is not the call it made" in done["reward_error"]
    assert again.requests == [], "nothing sampled for a sample that went astray"


def test_a_reply_stopped_by_another_ranks_stop_of_a_shared_engine_goes_on_at_once(tokenizer):
    engine = Stopping(tokenizer, "other")
    agents = engine.agents = _agents(tokenizer, calculator([]), engine)
    _text, prompt_ids, [done], _ = _through(agents, agents.run(engine, TASK, n=1, seed="s"))
    assert done["finish_reason"] == "stop" and done["turns"][1]["text"] == "\\box\\boxed{6}" and done["reward"] == 1.0
    box = tokenizer("\\box", add_special_tokens=False)["input_ids"]
    assert engine.requests[2].prompts[0] == engine.requests[1].prompts[0] + box, "from the ids it had"
