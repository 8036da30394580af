"""Agents written against the OpenAI API, for real (rl.agent): the chat demo's model behind
each rank's agent endpoint, an agent using the openai client, two ranks. A rank killed
mid-agent, then the run again: every task exactly once, the durable records kept; agents that
raise, hang past rl.env_timeout_s or call after they returned cost only their samples."""

import os

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, kill_rank_0_mid_rollout_then_rerun, rl_flags, status_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("openai")

AGENTS = '''
import asyncio

import openai

from orchestrator import rewards
from orchestrator.agents.clients import client

STALES = {}  # per rollout (its event loop): base URLs of samples whose agent returned; a later sample calls one (409)


async def solve(task, base_url):
    """One call; the answer scored by the math reward. test-000000's agent raises, test-000001's hangs."""
    if task["id"] == "test-000000":
        raise ZeroDivisionError("boom in the agent")
    if task["id"] == "test-000001":
        await asyncio.sleep(3600)
    STALE = STALES.setdefault(id(asyncio.get_running_loop()), [])
    late = 0
    for _ in range(40 if task["id"].endswith(("1", "5")) else 0):  # some wait (2 s at most) for a sample to have returned
        if STALE:
            break
        await asyncio.sleep(0.05)
    if STALE:
        try:
            await client(STALE.pop()).chat.completions.create(model="policy", messages=task["prompt"])
            late = -1  # served: wrong
        except openai.ConflictError:
            late = 1
    reply = await client(base_url).chat.completions.create(model="policy", messages=task["prompt"], max_tokens=48)
    STALE.append(base_url)
    return {"reward": rewards.math(task, reply.choices[0].message.content or ""), "metrics": {"late_refused": late}}


async def two_calls(task, base_url):
    """Answers, hears "check it", answers again (the reply sent back as the client got it)."""
    messages = list(task["prompt"])
    first = (await client(base_url).chat.completions.create(model="policy", messages=messages)).choices[0].message
    messages += [first.model_dump(), {"role": "user", "content": "check it"}]
    second = (await client(base_url).chat.completions.create(model="policy", messages=messages)).choices[0].message
    return second.content or ""
'''


@pytest.fixture
def user_agents(tmp_path):
    (tmp_path / "user_agents.py").write_text(AGENTS)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_an_openai_client_agent_on_two_ranks_through_faults_and_a_kill_9_runs_each_task_once(chat_demo_data, tmp_path, user_agents):
    """Rank 0 killed mid-agent, then the run again; eval's agents raise on one task and hang on
    another; calls with a returned sample's URL: the run completes, each task once, the
    errors recorded and counted, the late calls refused."""
    log_path = tmp_path / "run"
    flags = rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=1, extra=[
        "rl.agent=user_agents:solve", "rl.reward=orchestrator.rewards:math", "rl.env_timeout_s=3", "rl.max_reward_error_fraction=1.0",
        "rl.train_tasks=64", "coordination.work_stealing=false"])
    kill_rank_0_mid_rollout_then_rerun(flags, user_agents, tasks=64)
    layout = RunLayout(log_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_demo_data / "model")
    train = aggregate_records(layout, 1)
    for record in train:
        for s in record["samples"]:
            assert "reward_error" not in s, s["reward_error"]
            assert len(s["token_ids"]) == len(s["loss_mask"]) == len(s["logprobs"]) <= 48 and all(s["loss_mask"])
            assert tokenizer.decode(s["token_ids"]).startswith(s["turns"][0]["text"]), "the ids the engine sampled"
    evals = {r["task_id"]: r for r in aggregate_records(layout, 1, "eval")}
    assert all("ZeroDivisionError: boom in the agent" in s["reward_error"] for s in evals["test-000000"]["samples"])
    assert all("took longer than rl.env_timeout_s=3" in s["reward_error"] for s in evals["test-000001"]["samples"])
    late = [s["metrics"]["late_refused"] for r in train for s in r["samples"]]
    assert min(late) >= 0 and sum(late) >= 4, "a call with a returned sample's URL is refused (409)"
    (shown,) = status_json(log_path)["iterations"]
    assert shown["reward_errors"]["eval"]["count"] == 4 and "env/late_refused" in shown["metrics"]
    assert layout.checkpoint(1).is_dir(), "the update trained on the agent's samples"
