"""A second model in the loop, for real: a teacher (models.teacher, rl.teacher) served by an
engine of its own beside the policy's on each rank that rolls out, two ranks. The teacher's
engine killed mid-rollout is named as any engine is and fails its rank; the run again finishes.
Every train sample is recorded with the teacher's log-prob of each of its ids, which match the
teacher model's own forward pass over them; eval is never scored; the update trains on them
and reports the reverse KL."""

import json
import os
import re
import signal

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import (aggregate_records, engine_pid, held_mid_rollout, hold_after_first_batch, kill_tree, rl_flags,
                           run_local, start_ranks, status_json, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODE_TIMEOUT_S = 5  # RL_SMALL's coordination.node_timeout_s

def test_teacher_logprobs_of_every_train_token_match_its_forward_pass_and_its_engine_killed_is_named(chat_demo_data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    log_path = tmp_path / "run"
    layout = RunLayout(log_path)
    teacher = chat_demo_data / "model"  # the base itself: the forward pass below is the check, not what it teaches
    # 32 tasks a rank, 8 prompts in flight (rollout.max_inflight 32 at 4 samples): its first
    # durable batch (16 records, or what came within 0.5 s) leaves it part-way.
    flags = rl_flags(chat_demo_data, log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=[
        f"models.teacher.path={teacher}", "rl.teacher=teacher", "rl.distill_coef=1", "rl.train_tasks=64", "rl.max_tokens=24",
        "coordination.work_stealing=false"])
    procs = start_ranks(flags, 2, env_for=hold_after_first_batch(1, 2))
    try:
        wait_for(lambda: held_mid_rollout(layout, 1) or any(p.poll() is not None for p in procs), 180,
                 "rank 1 to be held part-way through its rollout of iteration 2")
        assert all(p.poll() is None for p in procs), status_json(log_path).get("failure")
        pid = engine_pid(procs[1].pid, "teacher")
        os.kill(pid, signal.SIGKILL)
        codes = [p.wait(timeout=NODE_TIMEOUT_S + 60) for p in procs]
        assert codes == [3, 1], codes
    finally:
        for p in procs:
            kill_tree(p.pid)
    failure = status_json(log_path)["failure"]
    assert failure["rank"] == 1 and failure["iteration"] == 2, failure
    assert re.search(rf"teacher engine 0 of rank 1 \(pid {pid}\) exited with code -9", failure["error"]), failure
    result = run_local(flags, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]

    model = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32).eval()
    worst, scored = 0.0, 0
    for i in (1, 2):
        assert all("teacher_logprobs" not in s for r in aggregate_records(layout, i, "eval") for s in r["samples"]), "eval is not scored"
        for r in aggregate_records(layout, i):
            prompt = r["prompt_token_ids"]
            for s in r["samples"]:
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
