"""Partial rollouts for real (rollout.partial, data/carry.py). Two ranks rolling out against a
heavy-tailed engine (bench/partial.py's: a sample's length and pace are its own, so a stop always
finds the long ones part-way) stop their unfinished groups, which the next iteration continues
from their recorded tokens; every rank killed (kill -9) part-way through the rollout that
continues them, and the run resumed on one node: every task drawn is aggregated for training
exactly once, every carried sample continued from its recorded ids, no token past the staleness
bound. And multi-turn samples (rl.environment, and rl.agent) on the chat demo's embedded engine,
stopped in a turn or between turns, continued where they were, trained."""

import json
import os
import signal
import threading

import pytest

from bench.partial import TailEngine
from orchestrator.phase_table import Phase
from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, kill_tree, rl_flags, run_local, start_ranks, status_json, wait_state
from tests.system.test_environments import ENVS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 12 tasks trained of 18 rolled out an iteration, a prompt a request.
PARTIAL = ["rl.train_tasks=12", "rollout.partial=true", "rollout.oversample=0.5", "rollout.prompts_per_request=1"]


@pytest.fixture
def tail_engine():
    """Samples of 4 to 12 tokens, or for 10% of them 40, a token every 50 ms (the lengths drawn
    from each request's seed: the same on every run)."""
    engine = TailEngine(median=8, tail_fraction=0.1, tail_factor=5, token_s=0.05)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        yield engine
    finally:
        engine.shutdown()
        engine.server_close()


def _records(layout, i, split):
    path = layout.iteration(i).aggregate(split)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_carried_groups_continue_from_their_tokens_and_every_task_trains_once_across_kill_9_and_fewer_nodes(
        chat_demo_data, tmp_path, tail_engine):
    log_path = tmp_path / "run"
    flags = rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", rl_phase="rollout", max_iterations=3, extra=[
        *PARTIAL, "--rollout-split=train-only", "--debug-mode", f"rollout.engine_url={tail_engine.url}", "rl.max_tokens=40"])
    layout = RunLayout(log_path)
    # Rank 0 held as iteration 2's rollout begins, rank 1 once its first records of it are durable.
    procs = start_ranks(flags, 2, env_for={0: {"ORCHESTRATOR_FAULT": f"hold@2:{int(Phase.ROLLOUT)}"},
                                           1: {"ORCHESTRATOR_FAULT": f"hold-after-batch@2:{int(Phase.ROLLOUT)}"}})
    try:
        for rank in (0, 1):
            wait_state(layout, rank, "held", timeout=180)
        assert layout.iteration(2).shard("train", 1).stat().st_size and not layout.iteration(2).shard("train", 0).exists()
        carried = _records(layout, 1, "carry")
        assert any(s["token_ids"] for r in carried for s in r["samples"] if s["finish_reason"] == "abort"), \
            "iteration 1 carried samples stopped part-way"
        for p in procs:  # every process
            os.kill(p.pid, signal.SIGKILL)
            kill_tree(p.pid)
        for p in procs:
            p.wait(timeout=10)
    finally:
        for p in procs:
            kill_tree(p.pid)
    result = run_local([*[f for f in flags if not f.startswith(("--num-nodes", "--rank-weights"))], "--num-nodes=1",
                        "--rank-weights=1"], timeout=240)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]

    drawn, trained = set(), []
    for i in (1, 2, 3):
        pool = _records(layout, i, "pool")
        assert len(pool) == 18 and len({r["task_id"] for r in pool}) == 18
        drawn |= {(i, r["task_id"]) for r in pool if r.get("origin_iteration", i) == i}
        train = aggregate_records(layout, i)
        assert len(train) == 12, f"iteration {i} trains rl.train_tasks groups"
        trained += [(r.get("origin_iteration") or r["iteration"], r["task_id"]) for r in train]
        for r in train:
            assert not r.get("unfinished") and all(s["finish_reason"] != "abort" and "reward" in s for s in r["samples"])
            assert all(v == 0 for s in r["samples"] for v, n in s.get("policy_versions") or [[r["policy_iteration"], 1]]), \
                "a rollout-only run samples with the base model only"
        # Each carried sample went on from the ids (and log-probs) it had when it was stopped.
        later = {r["task_id"]: r for r in pool}
        for c in _records(layout, i - 1, "carry") if i > 1 else []:
            for before, after in zip(c["samples"], later[c["task_id"]]["samples"]):
                assert after["token_ids"][: len(before["token_ids"])] == before["token_ids"]
                assert after["logprobs"][: len(before["logprobs"])] == before["logprobs"]
    left = [(r["origin_iteration"], r["task_id"]) for r in _records(layout, 3, "carry")]
    assert len(trained) == len(set(trained)), "a task trained twice"
    assert sorted(trained + left) == sorted(drawn), "every task drawn is trained once or still carried"
    partial = [it["partial"] for it in status_json(log_path)["iterations"]]
    assert all(p["dropped"] == 0 and p["trained"] == 12 for p in partial), partial
    assert sum(p["carried_in"] for p in partial) > 0 and partial[0]["carried_in"] == 0


SLOW_RETRY = ENVS + '''

class SlowRetry(Retry):
    """Retry's answers, each after a while, some long (as the agent's below): a stop finds
    samples in their environment call, begun."""

    def step(self, completion):
        time.sleep(1.5 if self.turn == 0 and self.task["id"][-1] in "13579" else 0.05)
        return super().step(completion)
'''


SLOW_AGENT = """
import asyncio

from orchestrator import rewards
from orchestrator.agents.clients import client


async def retry(task, base_url):
    \"\"\"SlowRetry as an agent through the endpoint: answers, is told "check it" (after a while in
    its own code), answers again, graded by the math reward.\"\"\"
    messages = list(task["prompt"])
    first = (await client(base_url).chat.completions.create(model="policy", messages=messages)).choices[0].message
    await asyncio.sleep(1.5 if task["id"][-1] in "13579" else 0.05)  # some long: a stop finds them between calls
    messages += [first.model_dump(), {"role": "tool", "content": "check it"}]
    second = (await client(base_url).chat.completions.create(model="policy", messages=messages)).choices[0].message
    return rewards.math(task, second.content or "")
"""


@pytest.mark.parametrize("how", ["environment", "agent"])
def test_multi_turn_samples_stopped_in_a_turn_or_between_turns_continue_where_they_were(chat_demo_data, tmp_path, how):
    """rl.environment (or rl.agent) with rollout.partial, one rank, trained: a stopped sample's
    environment is given its turns again (its agent run again, its calls answered from the
    record) and the sample goes on from its ids; every task trained once, no token more than
    one checkpoint old, eval never partial; the agent's samples, carried ones too, are scored by a
    teacher once finished."""
    (tmp_path / "retry_env.py").write_text(SLOW_RETRY)
    (tmp_path / "retry_agent.py").write_text(SLOW_AGENT)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log_path = tmp_path / "run"
    # The agent's run distills too: its samples (carried ones whole, once finished) scored by a teacher.
    teacher = [f"models.teacher.path={chat_demo_data / 'model'}", "rl.teacher=teacher", "rl.distill_coef=0.1"]
    runs = ["rl.environment=retry_env:SlowRetry", "rl.max_turns=2"] if how == "environment" else ["rl.agent=retry_agent:retry", *teacher]
    flags = rl_flags(chat_demo_data, log_path, num_nodes=1, weights=None, max_iterations=3, extra=[
        *PARTIAL, *runs, "rl.reward=orchestrator.rewards:math", "rl.temperature=3", "rollout.max_inflight=64", "rl.max_tokens=48"])
    result = run_local(flags, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    layout = RunLayout(log_path)
    drawn, trained, begun = set(), [], 0
    for i in (1, 2, 3):
        pool = {r["task_id"]: r for r in _records(layout, i, "pool")}
        drawn |= {(i, t) for t, r in pool.items() if r.get("origin_iteration", i) == i}
        train = aggregate_records(layout, i)
        assert len(train) == 12
        trained += [(r.get("origin_iteration") or r["iteration"], r["task_id"]) for r in train]
        for r in train:
            for s in r["samples"]:
                assert s["finish_reason"] != "abort" and "reward" in s and len(s["token_ids"]) == len(s["loss_mask"]) == len(s["logprobs"])
                assert "reward_error" not in s, s["reward_error"]
                if how == "agent":
                    taught = s["teacher_logprobs"]
                    assert len(taught) == len(s["token_ids"]) and all(t == 0.0 for t, m in zip(taught, s["loss_mask"]) if not m)
                    sampled = [t for t, m in zip(taught, s["loss_mask"]) if m]
                    assert all(t <= 0 for t in sampled) and any(t < 0 for t in sampled), "the sampled ids scored"
                ages = [i - 1 - v for v, n in s.get("policy_versions") or [[r["policy_iteration"], 1]] if n]
                assert max(ages, default=0) <= 0 + 1, f"a token of {r['task_id']} past rl.max_staleness + rollout.max_carry"
        assert all("unfinished" not in r and "carried" not in r for r in _records(layout, i, "eval")), "eval is never partial"
        for c in _records(layout, i - 1, "carry") if i > 1 else []:
            for before, after in zip(c["samples"], pool[c["task_id"]]["samples"]):
                if before["finish_reason"] != "abort":  # as it was (the teacher scores the group once it is complete)
                    assert {k: v for k, v in after.items() if k != "teacher_logprobs"} == {
                        k: v for k, v in before.items() if k != "teacher_logprobs"}
                    continue
                begun += bool(before["token_ids"])
                n = len(before["token_ids"])
                assert after["token_ids"][:n] == before["token_ids"] and after["loss_mask"][:n] == before["loss_mask"]
                assert after["logprobs"][:n] == before["logprobs"]
                done = before["turns"][:-1] if before["turns"] and before["turns"][-1].get("finish_reason") == "abort" else before["turns"]
                assert after["turns"][: len(done)] == done, "the turns it had, as they were"
                if len(done) < len(before["turns"]):  # stopped in its turn: the same turn, gone on
                    assert after["turns"][len(done)]["text"].startswith(before["turns"][-1]["text"])
    assert begun, "a carried sample had begun"
    left = [(r["origin_iteration"], r["task_id"]) for r in _records(layout, 3, "carry")]
    assert len(trained) == len(set(trained)) and sorted(trained + left) == sorted(drawn)
