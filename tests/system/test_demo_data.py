"""`orchestrator demo-data`: tasks and a warm-started base model, made locally and
deterministically, in the Hugging Face format vLLM serves."""

import json
import subprocess
import sys

import pytest

from orchestrator.demo import tasks as demo_tasks
from tests.harness import file_sha256

pytestmark = pytest.mark.timeout(180)


def _demo_data(path, *extra):
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}", *extra],
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_demo_data_is_complete_deterministic_and_loads_as_a_llama_checkpoint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    manifest = _demo_data(a, "--warm-steps=20")
    _demo_data(b, "--warm-steps=20")
    assert manifest["tasks"] == {"train": 2000, "test": 500}
    assert manifest["warm_steps"] == 20 and 0 <= manifest["validation_accuracy"] <= 1
    assert manifest["settings"] == {"seed": 0, "warm_steps_fixed": 20}, "as before the chat demo: demo data made then is reused"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / "model" / name).is_file()
        assert file_sha256(a / "model" / name) == file_sha256(b / "model" / name), f"{name} differs between two runs with one seed"
    assert not list((a / "model").glob("*.bin")), "weights are safetensors only"

    train, test = demo_tasks.read_tasks(a / "tasks" / "train.jsonl"), demo_tasks.read_tasks(a / "tasks" / "test.jsonl")
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in test}, "eval prompts are held out"
    assert all(str(eval(t["prompt"][:-1])) == t["answer"] for t in train[:50])  # noqa: S307 - our own a+b strings

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(a / "model")
    assert config.model_type == "llama" and config.hidden_size // config.num_attention_heads >= 32
    AutoModelForCausalLM.from_pretrained(a / "model", use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(a / "model")
    ids = tok("17+25=")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "17+25="


@pytest.mark.slow
def test_demo_data_is_reused_when_already_made_with_the_same_settings(tmp_path):
    _demo_data(tmp_path, "--warm-steps=5")
    before = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    _demo_data(tmp_path, "--warm-steps=5")
    assert (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_band_out_of_reach_within_the_step_cap_fails_naming_what_to_do_and_leaves_no_model(tmp_path):
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={tmp_path}", "--max-warm-steps=10"],
                            capture_output=True, text=True, timeout=150)
    assert result.returncode == 1
    assert "after 10 warm-start steps, still below the band [0.30, 0.40]" in result.stderr and "--max-warm-steps" in result.stderr
    assert not (tmp_path / "model").exists() and not (tmp_path / "demo.json").exists()
    assert not list(tmp_path.glob(".model.*")), "the staging directory is cleaned up"


@pytest.mark.parametrize("band", ["0.4,0.25", "0.3", "a,b", "0.2,1.5"])
def test_a_bad_accuracy_band_is_refused_before_anything_is_written(tmp_path, band):
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={tmp_path / 'd'}", f"--accuracy-band={band}"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--accuracy-band" in result.stderr
    assert not (tmp_path / "d").exists()


def test_relative_data_path_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", "--data-path=rel"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and "absolute" in result.stderr
    assert list(tmp_path.iterdir()) == []
