"""Multi-turn rollouts for real (rl.environment): the chat demo's model takes turns with a
user environment through the embedded engine's token-id prompts, ranks train on the turns
with the environment's messages masked, and environments that raise, hang, or whose rank is
killed mid-conversation cost only their samples."""

import json
import os

import pytest

from orchestrator.protocol.layout import RunLayout
from orchestrator.data import turns
from tests.harness import aggregate_records, kill_rank_0_mid_rollout_then_rerun, rl_flags, status_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENVS = '''
import threading
import time

from orchestrator.plugins import rewards
from orchestrator.environments import Step

HANG = threading.Event()


class Retry:
    """The model's first turn gets a tool message back; the second is graded by the math reward."""

    def __init__(self, task):
        self.task, self.turn = task, 0

    def reset(self):
        return self.task["prompt"]

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return Step(observation=[{"role": "tool", "content": "check it"}])
        return Step(reward=rewards.math(self.task, completion), done=True)


class Faulty(Retry):
    """Fails to open once per process (its first train sample), takes 0.2 s a train step (a rank
    killed mid-rollout has conversations mid-way), raises on test-000000's first step and hangs
    on test-000001's."""

    opened = 0

    def reset(self):
        if self.task["id"].startswith("train"):
            Faulty.opened += 1
        if Faulty.opened == 1 and self.task["id"].startswith("train"):
            raise RuntimeError("no sandbox for the first sample")
        return super().reset()

    def step(self, completion):
        if self.turn == 0 and self.task["id"] == "test-000000":
            raise ZeroDivisionError("boom in the environment")
        if self.turn == 0 and self.task["id"] == "test-000001":
            HANG.wait()
        if self.task["id"].startswith("train"):
            time.sleep(0.2)
        return super().step(completion)
'''


@pytest.fixture
def user_envs(tmp_path):
    (tmp_path / "user_envs.py").write_text(ENVS)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _turns(env: str) -> list[str]:
    """Conversations with ENVS' ``env``, graded by the math reward: short turns, at most 3."""
    return [f"rl.environment=user_envs:{env}", "rl.reward=orchestrator.rewards:math", "rl.max_tokens=48", "rl.max_turns=3"]


def test_two_ranks_train_on_turns_through_a_kill_9_and_environments_that_raise_or_hang_cost_only_their_samples(
        chat_demo_data, tmp_path, user_envs):
    """Rank 0 killed (kill -9) mid-conversations, then the run again: every task once, the
    durable records kept; the turns recorded token-exact with the tool's message masked; an
    environment that fails to open, raises or hangs costs only its samples, counted."""
    log_path = tmp_path / "run"
    # 32 tasks of 4 samples a rank, 16 tasks in hand at a time, each train step 0.2 s: when the first
    # batch is durable rank 0 still has conversations mid-way. Without work stealing, so its share
    # stays its own. Every failure tolerated: which batch each lands in decides when a lower limit
    # trips, and the limit's rule is the rewards' (tests/unit/test_scoring.py, test_rl_loop's failing reward).
    flags = rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=1, extra=[
        *_turns("Faulty"), "rl.env_timeout_s=3", "rl.max_reward_error_fraction=1.0", "rl.train_tasks=64",
        "coordination.work_stealing=false"])
    kill_rank_0_mid_rollout_then_rerun(flags, user_envs, tasks=64)
    layout = RunLayout(log_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_demo_data / "model")
    observation = turns.observation_ids(tokenizer, [{"role": "tool", "content": "check it"}])
    train = aggregate_records(layout, 1)
    multi = 0
    for record in train:
        assert record["prompt_token_ids"] == turns.render(tokenizer, _task(chat_demo_data, record["task_id"]), generation_prompt=True)
        for s in record["samples"]:
            assert len(s["token_ids"]) == len(s["loss_mask"]) == len(s["logprobs"]) <= 48
            if s["finish_reason"] == "stop" and "reward_error" not in s:
                assert len(s["turns"]) == 2
            if len(s["turns"]) < 2:
                continue
            multi += 1
            first = s["turns"][0]
            assert first["observation"] == [{"role": "tool", "content": "check it"}]
            start = first["tokens"] + (first["observation_tokens"] - len(observation))  # the turn closed with EOS if it was cut
            assert s["token_ids"][start : start + len(observation)] == observation, "the tool's ids as the template renders them"
            assert s["loss_mask"] == [1] * first["tokens"] + [0] * first["observation_tokens"] + [1] * s["turns"][1]["tokens"]
            assert "<|im_start|>tool\ncheck it<|im_end|>" in s["text"]
    assert multi >= 128, "most samples took two turns"
    failed = [s for r in train for s in r["samples"] if "reward_error" in s]
    # Once per rank process whose first train sample is in the aggregate: each rank's, before the kill and after.
    assert 1 <= len(failed) <= 4 and all("no sandbox" in s["reward_error"] and s["token_ids"] == [] for s in failed)

    evals = {r["task_id"]: r for r in aggregate_records(layout, 1, "eval")}
    raised = evals["test-000000"]["samples"]
    hung = evals["test-000001"]["samples"]
    assert all(s["reward"] == 0.0 and "ZeroDivisionError: boom in the environment" in s["reward_error"] for s in raised)
    assert all(s["reward"] == 0.0 and "took longer than rl.env_timeout_s=3" in s["reward_error"] for s in hung)
    shown = status_json(log_path)["iterations"][0]
    assert 1 < shown["metrics"]["turns"] <= 2, "the eval counts the model's turns"
    errors = shown["reward_errors"]
    assert errors["train"]["count"] == len(failed) and errors["eval"]["count"] == 4 and errors["eval"]["samples"] == 32
    assert layout.checkpoint(1).is_dir(), "the update trained on the turns"


def _task(data, task_id):
    split = "train" if task_id.startswith("train") else "test"
    for line in (data / "tasks" / f"{split}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["id"] == task_id:
            return row["prompt"]
    raise KeyError(task_id)
