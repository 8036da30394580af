"""Agents written against the OpenAI API, for real (rl.agent): the chat demo's model behind
each rank's agent endpoint, an agent using the openai client, two ranks. Agents that raise,
hang past rl.env_timeout_s or call after they returned cost only their samples; a rank killed
mid-agent, then the run again: every task exactly once, the durable records kept."""

import json
import os
import signal

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import (NODE_TIMEOUT_S, aggregate_records, hold_after_first_batch, kill_tree, rl_flags, run_local, start_ranks,
                           status_json, wait_held_mid_rollout)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("openai")

AGENTS = '''
import asyncio
import threading

import openai

from orchestrator import rewards

STALE = []  # base URLs of samples whose agent returned: a later sample calls one (refused: 409)


async def solve(task, base_url):
    """One call; the answer scored by the math reward. test-000000's agent raises, test-000001's hangs."""
    if task["id"] == "test-000000":
        raise ZeroDivisionError("boom in the agent")
    if task["id"] == "test-000001":
        await asyncio.sleep(3600)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    late = 0
    if STALE:
        stale = openai.AsyncOpenAI(base_url=STALE.pop(), api_key="none", max_retries=0)
        try:
            await stale.chat.completions.create(model="policy", messages=task["prompt"])
            late = -1  # served: wrong
        except openai.ConflictError:
            late = 1
    reply = await client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=48)
    STALE.append(base_url)
    return {"reward": rewards.math(task, reply.choices[0].message.content or ""), "metrics": {"late_refused": late}}


def slow(task, base_url):
    """A plain function (a worker thread), each call a while: the rank is mid-agent when held."""
    import time
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    time.sleep(0.2)
    reply = client.chat.completions.create(model="policy", messages=task["prompt"], max_tokens=48)
    return reply.choices[0].message.content or ""
'''


@pytest.fixture
def user_agents(tmp_path):
    (tmp_path / "user_agents.py").write_text(AGENTS)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_two_ranks_train_an_openai_client_agent_and_its_faults_cost_only_their_samples(chat_demo_data, tmp_path, user_agents):
    log_path = tmp_path / "run"
    result = run_local(rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=[
        "rl.agent=user_agents:solve", "rl.reward=orchestrator.rewards:math", "rl.env_timeout_s=3",
        "rl.max_reward_error_fraction=1.0"]), env=user_agents)
    assert result.returncode == 0, result.stdout[-6000:]
    layout = RunLayout(log_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_demo_data / "model")
    for i in (1, 2):
        train = aggregate_records(layout, i)
        assert len({r["task_id"] for r in train}) == len(train) == 8
        for record in train:
            for s in record["samples"]:
                assert "reward_error" not in s, s["reward_error"]
                assert len(s["token_ids"]) == len(s["loss_mask"]) == len(s["logprobs"]) <= 48 and all(s["loss_mask"])
                assert tokenizer.decode(s["token_ids"]).startswith(s["turns"][0]["text"]), "the ids the engine sampled"
        evals = {r["task_id"]: r for r in aggregate_records(layout, i, "eval")}
        assert all("ZeroDivisionError: boom in the agent" in s["reward_error"] for s in evals["test-000000"]["samples"])
        assert all("took longer than rl.env_timeout_s=3" in s["reward_error"] for s in evals["test-000001"]["samples"])
    late = [s["metrics"]["late_refused"] for i in (1, 2) for r in aggregate_records(layout, i) for s in r["samples"]]
    assert min(late) >= 0 and sum(late) >= 4, "a call with a returned sample's URL is refused (409)"
    shown = status_json(log_path)["iterations"]
    assert all(it["reward_errors"]["eval"]["count"] == 4 for it in shown)
    assert all("env/late_refused" in it["metrics"] for it in shown)
    assert layout.checkpoint(2).is_dir(), "the update trained on the agent's samples"


def test_kill_9_mid_agent_then_rerun_runs_each_task_once(chat_demo_data, tmp_path, user_agents):
    log_path = tmp_path / "run"
    flags = rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=1, extra=[
        "rl.agent=user_agents:slow", "rl.reward=orchestrator.rewards:math", "rl.train_tasks=64", "coordination.work_stealing=false"])
    procs = start_ranks(flags, 2, env_for={r: {**user_agents, **e} for r, e in hold_after_first_batch(0).items()} | {1: user_agents})
    try:
        layout = RunLayout(log_path)
        wait_held_mid_rollout(layout, 0)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=10)
        assert procs[1].wait(timeout=NODE_TIMEOUT_S + 60) == 3
        partial = layout.iteration(1).shard("train", 0).read_text().splitlines()
        assert 0 < len(partial) < 32
    finally:
        for p in procs:
            kill_tree(p.pid)
    result = run_local([*flags, "--num-nodes=2"], env=user_agents)
    assert result.returncode == 0, result.stdout[-6000:]
    records = aggregate_records(layout, 1)
    assert len(records) == 64 and len({r["task_id"] for r in records}) == 64
    kept = [json.loads(line) for line in layout.iteration(1).shard("train", 0).read_text().splitlines()]
    assert kept[: len(partial)] == [json.loads(line) for line in partial], "what was durable stays as it was"
