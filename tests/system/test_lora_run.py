"""LoRA (train.lora_rank) end to end with the embedded engine: the README's main job learns
with adapters; on two ranks with FSDP and a KL term a train worker killed with kill -9
mid-update and the same commands run again give the adapter an uninterrupted run gives; every checkpoint is the
adapter alone; the engines merge each new adapter in place without loading the base again;
and `orchestrator export` writes a merged model that AutoModelForCausalLM loads and that
gives the engine's log-probs."""

import json
import re
import subprocess
import sys

import pytest

from orchestrator import checkpoints
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, exit_codes, kill_trainer_mid_update, start_ranks, status_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODE_TIMEOUT_S = 10


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(path)


def test_main_job_with_lora_learns_fifteen_points(readme_demo_data, tmp_path):
    log = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", f"--data-path={readme_demo_data.path}", f"--log-path={log}", "--rl-phase=both",
         "--eval-interval=3", "--max-iterations=10", "train.lora_rank=16"],
        capture_output=True, text=True, timeout=850)
    assert result.returncode == 0, result.stderr[-4000:]
    evaluated = [it for it in status_json(log)["iterations"] if it["evaluated"]]
    curve = [round(it["metrics"]["accuracy"], 3) for it in evaluated]
    print(f"LoRA rank 16, seed 0: eval accuracy {curve}")
    assert [it["iteration"] for it in evaluated] == [1, 4, 7, 10]
    assert curve[-1] - curve[0] >= 0.15, f"eval accuracy {curve}"

    layout = RunLayout(log)
    stats = json.loads((layout.checkpoint(10) / "train_stats.json").read_text())
    assert (stats["lora_rank"], stats["policy_from"]) == (16, "memory"), stats
    engine_log = layout.engine_log(0, 0).read_text()
    assert len(re.findall(r" loaded \S+ in ", engine_log)) == 1, "the engine loads the base model once"
    assert len(re.findall(r"reloaded \S+iter-\d+ in place .*\(LoRA adapter, merged into the base", engine_log)) == 9


def test_lora_on_two_ranks_with_fsdp_survives_a_killed_trainer_and_exports_a_merged_model(readme_demo_data, tmp_path):
    data = readme_demo_data.path
    common = ["--rl-phase=both", "--eval-interval=1", "--max-iterations=2", "--num-nodes=2", "--rank-weights=1,1",
              "train.strategy=fsdp", "train.lora_rank=16", "rl.train_tasks=64", "rl.eval_tasks=32",
              "rl.kl_coef=0.01",  # the KL reference: the base under the adapters, switched off
              "coordination.heartbeat_interval_s=0.5", f"coordination.node_timeout_s={NODE_TIMEOUT_S}"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert exit_codes(start_ranks([f"--data-path={data}", f"--log-path={whole}", *common], 2)) == [0, 0]

    flags = [f"--data-path={data}", f"--log-path={killed}", *common]
    kill_trainer_mid_update(start_ranks(flags, 2), killed, worker=1, rank=1, iteration=2, codes=[3, 1], timeout=300)
    assert exit_codes(start_ranks(flags, 2)) == [0, 0]

    a, b = (RunLayout(p).checkpoint(2) for p in (whole, killed))
    ours, theirs = _tensors(a / checkpoints.ADAPTER_WEIGHTS), _tensors(b / checkpoints.ADAPTER_WEIGHTS)
    assert ours.keys() == theirs.keys() and ours
    assert all(ours[k].equal(theirs[k]) for k in ours), "the rerun after kill -9 trained another adapter"
    stats = json.loads((b / "train_stats.json").read_text())
    # iteration 1's checkpoint holds the adapter but not its optimizer state (checkpoint.state_every):
    # the rerun's trainers trained iteration 1 again from its aggregate, then iteration 2
    assert (stats["strategy"], stats["world_size"], stats["policy_from"]) == ("fsdp", 2, "replayed 1..1"), stats
    assert stats["optimizer_continued_from_step"] > 0, stats

    # The checkpoint is the adapter and its optimizer state, in peft's format, sealed; no base weights.
    listed = set(fsio.read_record(b / checkpoints.MANIFEST)["files"])
    assert {checkpoints.ADAPTER_CONFIG, checkpoints.ADAPTER_WEIGHTS, "optimizer/adamw.safetensors.index.json"} <= listed
    assert not any(name.startswith("model") for name in listed), listed
    assert stats["checkpoint_bytes"] < 0.5 * sum(p.stat().st_size for p in (data / "model").glob("*.safetensors")) + 10**6

    # Each engine loaded the base once and took adapter 1 in place.
    for rank in (0, 1):
        engine_log = RunLayout(whole).engine_log(rank, rank).read_text()  # engine numbers are global: one a rank here
        # One load a start (a start that lost its port to the other rank's engine is retried), none a reload.
        assert len(re.findall(r" loaded \S+ in ", engine_log)) == len(re.findall(r"^=== .* start on ", engine_log, re.M))
        assert re.search(r"reloaded \S+iter-0+1 in place .*\(LoRA adapter, merged into the base", engine_log), engine_log[-2000:]

    # Exported, adapter 1 merged into the base: a plain model that gives the engine's log-probs
    # of iteration 2's eval samples, which the engines drew from adapter 1.
    out = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={whole}", "--iteration=1", f"--out={out}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "merged into" in result.stdout
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    records = aggregate_records(RunLayout(whole), 2, "eval")
    assert {r["policy"] for r in records} == {str(RunLayout(whole).checkpoint(1))}
    worst = 0.0
    for rec in records[:16]:
        for s in rec["samples"]:
            ids = rec["prompt_token_ids"] + s["token_ids"]
            with torch.inference_mode():
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
            start = len(rec["prompt_token_ids"]) - 1
            mine = [lp[start + i, t].item() for i, t in enumerate(s["token_ids"])]
            worst = max([worst, *(abs(x - y) for x, y in zip(mine, s["logprobs"]))])
    assert worst < 1e-3, f"the exported model's log-probs differ from the engine's by {worst}"

    # Refused before anything is written: an iteration without a checkpoint, an --out in use.
    again = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={whole}", "--iteration=5", f"--out={tmp_path / 'x'}"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "no checkpoint of iteration 5" in again.stderr and not (tmp_path / "x").exists()
    taken = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={whole}", f"--out={out}"],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 2 and "not an empty directory" in taken.stderr
