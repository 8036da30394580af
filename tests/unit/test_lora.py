"""LoRA: what the trainer writes (peft's format, adapters only) and what the embedded engine
makes of it (each adapter merged into the base in place) give the policy peft computes."""

import json

import pytest
import torch

from orchestrator import checkpoints
from orchestrator.demo import model as demo_model
from orchestrator.engine import lora as engine_lora
from orchestrator.train import lora as train_lora
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.request import TrainRequest
from orchestrator.train.settings import TrainerSettings, UpdateSettings

IDS = torch.tensor([[1, 5, 9, 12, 7, 3, 4]])


def _adapter(tmp_path, name, seed, rank=4, alpha=8.0):
    """The demo model with LoRA adapters of random (nonzero) weights, saved as the trainer saves
    them; returns the peft model (for its logits) and the directory."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(demo_model.create(0).eval(), LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False,
                                                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    out = tmp_path / name
    out.mkdir()
    assert train_lora.save(peft_model, out, rank=0) > 0
    return peft_model.eval(), out


def _logits(model):
    with torch.inference_mode():
        return model(input_ids=IDS).logits


def test_the_checkpoint_is_the_adapter_alone_in_peft_format(tmp_path):
    peft_model, out = _adapter(tmp_path, "a", seed=1)
    assert sorted(p.name for p in out.iterdir()) == [checkpoints.ADAPTER_CONFIG, checkpoints.ADAPTER_WEIGHTS]
    assert checkpoints.is_adapter(out)
    from peft import PeftModel

    again = PeftModel.from_pretrained(demo_model.create(0).eval(), str(out)).eval()
    torch.testing.assert_close(_logits(again), _logits(peft_model))
    from safetensors import safe_open

    with safe_open(out / checkpoints.ADAPTER_WEIGHTS, framework="pt") as f:
        assert f.keys() and all(".lora_A." in k or ".lora_B." in k for k in f.keys())


def test_the_engine_merges_an_adapter_into_its_base_as_peft_computes_it(tmp_path):
    peft_model, out = _adapter(tmp_path, "a", seed=1)
    served = demo_model.create(0).eval()
    base_logits = _logits(served)
    assert engine_lora.Merger(served).apply(out) == 2 * 2 + 2  # q, v per layer and down_proj, 2 layers
    torch.testing.assert_close(_logits(served), _logits(peft_model), atol=2e-5, rtol=1e-4)
    assert not torch.allclose(_logits(served), base_logits)


def test_each_adapter_is_merged_into_the_base_not_into_the_last_merge(tmp_path):
    first, a = _adapter(tmp_path, "a", seed=1)
    second, b = _adapter(tmp_path, "b", seed=2)
    served = demo_model.create(0).eval()
    merger = engine_lora.Merger(served)
    for _ in range(3):
        merger.apply(a)
        merger.apply(b)
    torch.testing.assert_close(_logits(served), _logits(second), atol=2e-5, rtol=1e-4)
    merger.apply(a)
    torch.testing.assert_close(_logits(served), _logits(first), atol=2e-5, rtol=1e-4)


def test_an_adapter_the_merge_does_not_cover_is_refused_and_the_model_untouched(tmp_path):
    _, out = _adapter(tmp_path, "a", seed=1)
    served = demo_model.create(0).eval()
    before = _logits(served)
    cfg = json.loads((out / checkpoints.ADAPTER_CONFIG).read_text())
    (out / checkpoints.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="only plain LoRA"):
        engine_lora.Merger(served).apply(out)
    (out / checkpoints.ADAPTER_CONFIG).write_text(json.dumps(cfg))
    wider = demo_model.create(0)
    wider.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 32, bias=False)
    with pytest.raises(ValueError, match="q_proj.weight by"):
        engine_lora.Merger(wider).apply(out)
    torch.testing.assert_close(_logits(served), before)


def _config(tmp_path, init, **lora):
    train = TrainerSettings(**lora)
    train.check()
    return TrainRequest(iteration=2, data=tmp_path / "d.jsonl", init_checkpoint=init, reference_checkpoint=None, output=tmp_path / "o",
                        seed=0, rl=UpdateSettings(lr=1e-3, epochs=1, micro_batch=1), base_model=tmp_path / "base", train=train)


def test_the_trainer_continues_an_adapter_only_with_the_settings_it_was_made_with(tmp_path):
    _, out = _adapter(tmp_path, "a", seed=1, rank=4, alpha=8.0)
    same = _config(tmp_path, out, lora_rank=4, lora_alpha=8.0, lora_target_modules=("v_proj", "q_proj", "down_proj"))
    model = train_lora.attach(demo_model.create(0).eval(), same)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
    with pytest.raises(BadTrainInput, match=r"r 4 \(the config: 16\)"):
        train_lora.attach(demo_model.create(0).eval(), _config(tmp_path, out, lora_rank=16, lora_alpha=8.0,
                                                               lora_target_modules=("v_proj", "q_proj", "down_proj")))


def test_fresh_adapters_start_as_the_base_and_only_they_train(tmp_path):
    base = demo_model.create(0).eval()
    before = _logits(base)
    model = train_lora.attach(base, _config(tmp_path, tmp_path / "base", lora_rank=8))
    torch.testing.assert_close(_logits(model), before)  # B = 0
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_the_preflight_names_a_target_module_the_base_lacks(tmp_path):
    from orchestrator import preflight
    from orchestrator.errors import ConfigError

    directory = tmp_path / "base"
    demo_model.create(0).save_pretrained(directory)
    preflight.check_lora_targets(directory, ["q_proj", "down_proj"])
    preflight.check_lora_targets(directory, ["all-linear"])
    with pytest.raises(ConfigError, match=r"names qkv_proj, which the model .* has no module of; its projections are down_proj, "
                                          r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        preflight.check_lora_targets(directory, ["q_proj", "qkv_proj"])


def test_with_adapters_off_the_policy_is_its_base_the_kl_reference(tmp_path):
    peft_model, _ = _adapter(tmp_path, "a", seed=1)
    base_logits = _logits(demo_model.create(0).eval())
    assert not torch.allclose(_logits(peft_model), base_logits)
    with train_lora.adapters_off(peft_model):
        torch.testing.assert_close(_logits(peft_model), base_logits)
    assert not torch.allclose(_logits(peft_model), base_logits)
