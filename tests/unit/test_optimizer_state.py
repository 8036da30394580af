"""AdamW's state saved with a checkpoint and loaded by the next trainer continues the same
optimizer: the steps after a save and load are the steps it would have taken anyway."""

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.checkpoints import optimizer_state


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _steps(model, optimizer, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_a_saved_and_loaded_optimizer_continues_bit_identically(tmp_path):
    straight = _model()
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    _steps(straight, opt, 3, seed=1)
    _steps(straight, opt, 3, seed=2)

    first = _model()
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _steps(first, opt1, 3, seed=1)
    optimizer_state.save(opt1, first, tmp_path)
    resumed = _model(seed=99)
    resumed.load_state_dict(first.state_dict())
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    assert optimizer_state.load(opt2, resumed, tmp_path) == 3
    _steps(resumed, opt2, 3, seed=2)

    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_state_is_plain_tensors_per_parameter_name_in_a_subdirectory(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _steps(model, opt, 1, seed=0)
    optimizer_state.save(opt, model, tmp_path)
    assert not list(tmp_path.glob("*.safetensors")), "nothing at the top level, where vLLM looks for weights"
    tensors = load_file(optimizer_state.path(tmp_path))
    assert set(tensors) == {f"{n}/{k}" for n, _ in model.named_parameters() for k in ("exp_avg", "exp_avg_sq", "step")}


def test_a_checkpoint_without_optimizer_state_gives_a_fresh_optimizer(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_state.load(opt, model, tmp_path) is None and not opt.state


def test_state_that_does_not_fit_the_model_is_refused_naming_the_file(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _steps(model, opt, 1, seed=0)
    optimizer_state.save(opt, model, tmp_path)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))
    with pytest.raises(ValueError, match=r"adamw.safetensors has shape \(8, 4\) for 0.weight"):
        optimizer_state.load(torch.optim.AdamW(wider.parameters()), wider, tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(ValueError, match="parameters the model lacks: 2.bias, 2.weight"):
        optimizer_state.load(torch.optim.AdamW(other.parameters()), other, tmp_path)
    optimizer_state.path(tmp_path).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="is unreadable"):
        optimizer_state.load(torch.optim.AdamW(model.parameters()), model, tmp_path)
