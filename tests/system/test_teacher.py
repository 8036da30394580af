"""Models beside the policy in the loop, for real, two ranks: a teacher (models.teacher,
rl.teacher) served by an engine of its own beside the policy's on each rank, and a judge
(models.judge, the judge reward) served by rank 1 alone (models.judge.nodes=1), which rank 0
finds on the shared filesystem and asks across. The judge's engine killed mid-rollout is named
as any engine is and fails its rank; rank 0, left without a judge, is told of rank 1's failure
rather than failing on its own; the run again finishes. Every train sample's reward is the judge's
reading of its reply, asked through judge.template (a file), and eval's is rl.eval_reward's; every
train sample is recorded with the teacher's log-prob of each of its ids, which match the teacher
model's own forward pass over them; eval is never scored; the update trains on them and reports
the reverse KL."""

import json
import os
import re
import signal

import pytest

from orchestrator import rewards
from orchestrator.plugins import judge
from orchestrator.protocol.layout import RunLayout
from tests.harness import (aggregate_records, engine_pid, held_mid_rollout, hold_after_first_batch, kill_tree, rl_flags,
                           run_local, start_ranks, status_json, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODE_TIMEOUT_S = 5  # RL_SMALL's coordination.node_timeout_s

def test_judged_rewards_and_teacher_logprobs_of_every_train_token_and_the_judges_engine_killed_is_named(chat_demo_data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    log_path = tmp_path / "run"
    layout = RunLayout(log_path)
    teacher = chat_demo_data / "model"  # the base itself: the forward pass below is the check, not what it teaches
    # The judge is the base too, asked the task's sum again after the completion: the number it
    # boxes is read as a score out of 100 (what it judges is not the check: that it is asked is).
    template = tmp_path / "judge.txt"
    template.write_text("{completion} What is {answer}? Put the answer in \\boxed{{}}.")
    # 32 tasks a rank, 8 prompts in flight (rollout.max_inflight 32 at 4 samples): its first
    # durable batch (16 records, or what came within 0.5 s) leaves it part-way.
    flags = rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=[
        f"models.teacher.path={teacher}", "rl.teacher=teacher", "rl.distill_coef=1", "rl.train_tasks=64", "rl.max_tokens=24",
        "coordination.work_stealing=false", f"models.judge.path={teacher}", "models.judge.nodes=1", "judge.model=judge", "rl.reward=orchestrator.rewards:judge",
        f"judge.template={template}", "judge.parse=score", "judge.max_score=100", "judge.max_tokens=8",
        "rl.eval_reward=orchestrator.rewards:math", "rl.max_reward_error_fraction=0.5"])
    procs = start_ranks(flags, 2, env_for=hold_after_first_batch(1, 2))
    try:
        wait_for(lambda: held_mid_rollout(layout, 1) or any(p.poll() is not None for p in procs), 180,
                 "rank 1 to be held part-way through its rollout of iteration 2")
        assert all(p.poll() is None for p in procs), status_json(log_path).get("failure")
        pid = engine_pid(procs[1].pid, "judge")
        os.kill(pid, signal.SIGKILL)
        codes = [p.wait(timeout=NODE_TIMEOUT_S + 60) for p in procs]
        assert codes == [3, 1], codes
    finally:
        for p in procs:
            kill_tree(p.pid)
    failure = status_json(log_path)["failure"]
    assert failure["rank"] == 1 and failure["iteration"] == 2, failure
    assert re.search(rf"judge engine 0 of rank 1 \(pid {pid}\) exited with code -9", failure["error"]), failure
    result = run_local(flags, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert not layout.engine_log(0, 0, "judge").exists(), "rank 0 serves no judge: it asks rank 1's"
    assert layout.engine_address(1, 0, "judge").exists() and layout.engine_log(0, 0, "teacher").exists()

    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    worst, scored, judged = 0.0, 0, 0
    for i in (1, 2):
        for r in aggregate_records(layout, i, "eval"):
            for s in r["samples"]:
                assert "teacher_logprobs" not in s and "judge_reply" not in s, "eval is neither distilled nor judged"
                assert s["reward"] == rewards.math({"answer": r["answer"]}, s["text"]), "eval's reward is rl.eval_reward's"
        for r in aggregate_records(layout, i):
            prompt = r["prompt_token_ids"]
            for s in r["samples"]:
                if "reward_error" not in s:
                    assert s["reward"] == judge.score(s["judge_reply"], "score", 100), s
                    judged += 1
                ids, got = s["token_ids"], s["teacher_logprobs"]
                assert len(got) == len(ids)
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
                want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
                worst = max(worst, (torch.tensor(got) - want).abs().max().item())
                scored += len(ids)
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert isinstance(stats.get("distill_reverse_kl"), float), stats
    assert scored and worst <= 1e-3, f"the teacher's log-probs are {worst:.2e} from its forward pass"
    assert judged, "the train samples' rewards are the judge's"
