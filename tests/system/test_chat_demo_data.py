"""`orchestrator demo-data --chat`: the demo's tasks as chat messages, a byte-level BPE
tokenizer trained locally with a ChatML template, and a tiny Qwen2 model whose answer,
``\\boxed{42}`` then ``<|im_end|>``, fits in rl.max_tokens."""

import json
import shutil
import subprocess
import sys

import pytest

from orchestrator.config import RLConfig
from orchestrator.data import tasks as data_tasks
from orchestrator.demo import chat_tokenizer, warm_start
from orchestrator.demo import tasks as demo_tasks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # the fixture trains the chat demo model


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path / "model")


def test_the_chat_tasks_are_the_demo_tasks_as_chat_messages(chat_demo_data):
    manifest = json.loads((chat_demo_data / "demo.json").read_text())
    assert manifest["settings"] == {"seed": 0, "warm_steps_fixed": 40, "chat": True}
    plain = demo_tasks.make_tasks(0)
    for split in ("train", "test"):
        chat = demo_tasks.read_tasks(chat_demo_data / "tasks" / f"{split}.jsonl")
        assert [(t["id"], t["answer"]) for t in chat] == [(t["id"], t["answer"]) for t in plain[split]]
        for c, p in zip(chat[:50], plain[split]):
            [message] = c["prompt"]
            assert message["role"] == "user" and f"{p['prompt'][:-1]}?" in message["content"] and "\\boxed{}" in message["content"]


def test_the_model_is_a_small_qwen2_that_ends_at_either_end_token(chat_demo_data):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(chat_demo_data / "model")
    assert config.model_type == "qwen2" and config.hidden_size // config.num_attention_heads >= 32, "vLLM's CPU attention"
    assert not config.tie_word_embeddings and config.vocab_size <= chat_tokenizer.VOCAB_SIZE
    tok = _tokenizer(chat_demo_data)
    im_end, endoftext = tok.convert_tokens_to_ids([chat_tokenizer.IM_END, chat_tokenizer.ENDOFTEXT])
    assert config.eos_token_id == im_end == tok.eos_token_id and config.pad_token_id == endoftext == tok.pad_token_id
    assert GenerationConfig.from_pretrained(chat_demo_data / "model").eos_token_id == [im_end, endoftext]
    assert not list((chat_demo_data / "model").glob("*.bin")), "weights are safetensors only"


def test_the_tokenizer_renders_a_task_with_its_chat_template_and_adds_no_bos(chat_demo_data):
    tok = _tokenizer(chat_demo_data)
    assert tok.chat_template and tok.bos_token is None
    task = demo_tasks.read_tasks(chat_demo_data / "tasks" / "train.jsonl")[0]
    text = data_tasks.render(task["prompt"], tok)  # as the rollout renders it
    assert text == f"<|im_start|>user\n{task['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert text == chat_tokenizer.chatml(task["prompt"], add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text
    assert len(ids) <= 24


def test_every_answer_and_its_end_token_fit_in_rl_max_tokens_and_every_prompt_in_the_context(chat_demo_data):
    from transformers import AutoConfig

    tok = _tokenizer(chat_demo_data)
    max_tokens = RLConfig().max_tokens
    assert tok.convert_ids_to_tokens(tok("\\boxed{98}<|im_end|>")["input_ids"]) == ["\\boxed", "{", "9", "8", "}", "<|im_end|>"]
    assert len(tok("\\boxed{98}<|im_end|>")["input_ids"]) <= max_tokens
    assert max(len(tok(demo_tasks.boxed(str(n)))["input_ids"]) + 1 for n in range(99)) <= max_tokens
    tasks = demo_tasks.read_tasks(chat_demo_data / "tasks" / "test.jsonl")
    longest = max(len(tok(data_tasks.render(t["prompt"], tok))["input_ids"]) for t in tasks)
    assert longest + max_tokens <= AutoConfig.from_pretrained(chat_demo_data / "model").max_position_embeddings


def test_the_tokenizer_is_the_same_on_every_build(chat_demo_data, tmp_path):
    corpus = chat_tokenizer.corpus(demo_tasks.make_tasks(0, chat=True)["train"], warm_start.CHAT.target)
    assert chat_tokenizer.build(corpus).to_str() == chat_tokenizer.build(corpus).to_str()
    chat_tokenizer.fast(corpus).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tmp_path / name).exists() or (chat_demo_data / "model" / name).exists():
            assert (tmp_path / name).read_bytes() == (chat_demo_data / "model" / name).read_bytes(), f"{name} differs from demo-data's"


def test_the_embedded_engine_stops_the_answer_at_the_end_of_the_turn(chat_demo_data):
    from orchestrator.plugins import rewards
    from orchestrator.demo import model as demo_model
    from orchestrator.engine.sampling import FinishReason, Sampler, SamplingParams

    model, tok = demo_model.load(chat_demo_data / "model")
    tasks = demo_tasks.read_tasks(chat_demo_data / "tasks" / "test.jsonl")[:8]
    generation = Sampler(model, tok).generate([data_tasks.render(t["prompt"], tok) for t in tasks],
                                              SamplingParams(temperature=0, max_tokens=RLConfig().max_tokens))
    for task, [sample] in zip(tasks, generation.samples):
        assert sample.finish_reason == FinishReason.STOP and sample.token_ids[-1] == tok.eos_token_id
        assert sample.text.startswith("\\boxed{") and rewards.math(task, sample.text) in (0.0, 1.0)


def test_the_chat_demo_is_reused_with_the_same_settings_and_replaced_by_the_default_one(chat_demo_data, tmp_path):
    path = tmp_path / "data"
    shutil.copytree(chat_demo_data, path)
    before = (path / "model" / "model.safetensors").stat().st_mtime_ns

    def demo_data(*extra):
        result = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}", *extra],
                                capture_output=True, text=True, timeout=150)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    demo_data("--chat", "--warm-steps=40")
    assert (path / "model" / "model.safetensors").stat().st_mtime_ns == before
    assert demo_data("--warm-steps=5")["settings"] == {"seed": 0, "warm_steps_fixed": 5}
    assert json.loads((path / "model" / "config.json").read_text())["model_type"] == "llama"
    assert isinstance(demo_tasks.read_tasks(path / "tasks" / "train.jsonl")[0]["prompt"], str)
