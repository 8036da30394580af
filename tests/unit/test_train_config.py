"""The trainer's config (train_config.TrainConfig) and the run config's rl.* keys check the same
bounds (config.py's LearningRate, Epochs, ...): a bad value fails at `orchestrator run`, not in the trainer."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import config
from orchestrator.errors import ConfigError
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.train_config import TrainConfig

GOOD = {
    "iteration": 1,
    "data": "/run/iterations/1/train.jsonl",
    "init_checkpoint": "/run/checkpoints/0",
    "reference_checkpoint": None,
    "output": "/run/checkpoints/1.staging",
    "seed": 7,
    "lr": 3e-4,
    "epochs": 2,
    "micro_batch": 2,
    "clip_eps": 0.2,
    "kl_coef": 0,
    "max_grad_norm": 1,
}


def _error(**over) -> str:
    with pytest.raises(ValueError) as raised:
        TrainConfig.from_json({**GOOD, **over})
    return str(raised.value)


def test_a_good_config_decodes_with_paths_as_paths_and_ints_as_floats():
    c = TrainConfig.from_json(GOOD)
    assert c.data == Path(GOOD["data"]) and c.reference_checkpoint is None
    assert c.kl_coef == 0.0 and isinstance(c.kl_coef, float) and isinstance(c.max_grad_norm, float)
    assert not c.uses_kl


def test_what_the_rank_writes_from_the_default_rl_config_decodes():
    """The keys and types of workloads/rl/workload.py's _trainer_config."""
    rl = config.RLConfig()
    written = {**GOOD, "reference_checkpoint": "/data/model",
               **{k: getattr(rl, k) for k in ("lr", "epochs", "micro_batch", "clip_eps", "kl_coef", "max_grad_norm")}}
    c = TrainConfig.from_json(written)
    assert (c.lr, c.epochs, c.micro_batch) == (rl.lr, rl.epochs, rl.micro_batch)


def test_missing_keys_are_all_named():
    with pytest.raises(ValueError, match="lacks lr, clip_eps"):
        TrainConfig.from_json({k: v for k, v in GOOD.items() if k not in ("lr", "clip_eps")})


@pytest.mark.parametrize("key,value,message", [
    ("lr", "0.1", "Expected `float`, got `str`"),
    ("epochs", 1.5, "Expected `int`, got `float`"),
    ("data", 5, "Expected `str`, got `int`"),
    ("reference_checkpoint", ["/a"], "Expected `str`, got `list`"),
    ("seed", None, "Expected `int`, got `null`"),
])
def test_a_value_of_the_wrong_type_is_named(key, value, message):
    assert _error(**{key: value}) == f"train config key {key!r} is {value!r}: {message}"


@pytest.mark.parametrize("key", ["iteration", "seed", "epochs", "micro_batch", "lr", "kl_coef"])
def test_a_bool_is_not_a_number(key):
    assert f"train config key {key!r} is True: Expected" in _error(**{key: True})


@pytest.mark.parametrize("key,value,bound", [
    ("lr", -1, "> 0.0"), ("lr", 0, "> 0.0"), ("clip_eps", 0.0, "> 0.0"), ("max_grad_norm", float("nan"), "> 0.0"),
    ("kl_coef", -0.1, ">= 0.0"), ("epochs", 0, ">= 1"), ("micro_batch", 0, ">= 1"), ("iteration", -1, ">= 0"),
])
def test_a_value_out_of_bounds_is_named(key, value, bound):
    assert _error(**{key: value}).startswith(f"train config key {key!r} is {value!r}: Expected `")
    assert _error(**{key: value}).endswith(bound)


@pytest.mark.parametrize("key", ["data", "init_checkpoint", "reference_checkpoint", "output"])
def test_paths_must_be_absolute(key):
    assert _error(**{key: "relative/dir"}) == f"train config key {key!r} is 'relative/dir': must be an absolute path"


def test_unknown_keys_are_logged_and_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.train.train_config"):
        c = TrainConfig.from_json({**GOOD, "zeta": 1, "alpha": 2})
    assert c == TrainConfig.from_json(GOOD)
    assert "ignoring unknown train config keys: alpha, zeta" in caplog.text


def test_not_an_object():
    with pytest.raises(ValueError, match="not a JSON object"):
        TrainConfig.from_json([GOOD])


def test_read_raises_bad_train_input_naming_the_file_and_the_key(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('{"lr": -1}')
    with pytest.raises(BadTrainInput, match=f"train config {path}: the train config lacks iteration, "):
        TrainConfig.read(path)
    path.write_text("{")
    with pytest.raises(BadTrainInput, match=f"train config {path}: "):
        TrainConfig.read(path)


@pytest.mark.parametrize("override,message", [
    ("rl.lr=-1", "rl.lr must be > 0, got -1.0"),
    ("rl.lr=0", "rl.lr must be > 0, got 0.0"),
    ("rl.clip_eps=0", "rl.clip_eps must be > 0, got 0.0"),
    ("rl.max_grad_norm=nan", "rl.max_grad_norm must be > 0, got nan"),
    ("rl.kl_coef=-0.5", "rl.kl_coef must be >= 0, got -0.5"),
    ("rl.epochs=0", "rl.epochs must be >= 1, got 0"),
    ("rl.micro_batch=-2", "rl.micro_batch must be >= 1, got -2"),
])
def test_the_run_config_checks_the_trainer_bounds(override, message):
    with pytest.raises(ConfigError) as raised:
        config.build_sections(config.parse_overrides([override]))
    assert str(raised.value) == message


@pytest.mark.parametrize("key,value", [("lr", -1.0), ("clip_eps", 0.0), ("max_grad_norm", 0.0), ("kl_coef", -0.5),
                                       ("epochs", 0), ("micro_batch", 0)])
def test_both_configs_refuse_the_same_values(key, value):
    with pytest.raises(ConfigError, match=f"rl.{key} must be"):
        config.RLConfig(**{key: value})
    with pytest.raises(ValueError, match=f"train config key {key!r}"):
        TrainConfig.from_json({**GOOD, key: value})


def test_importing_the_config_stays_cheap():
    code = "import sys, orchestrator.config; assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_rl_stop_takes_a_json_list_or_one_string_and_survives_the_fingerprint_round_trip():
    import dataclasses
    import json

    from orchestrator.config import build_sections, parse_overrides

    assert build_sections(parse_overrides(['rl.stop=["</answer>", "\\n\\n"]']))["rl"].stop == ["</answer>", "\n\n"]
    assert build_sections(parse_overrides(["rl.stop=</s>"]))["rl"].stop == ["</s>"]
    with pytest.raises(ConfigError, match="expected a JSON list of strings"):
        parse_overrides(["rl.stop=[1, 2]"])
    with pytest.raises(ConfigError, match="rl.stop must be non-empty strings"):
        build_sections(parse_overrides(['rl.stop=[""]']))
    rl = build_sections(parse_overrides(['rl.stop=["a"]']))["rl"]
    assert json.loads(json.dumps(dataclasses.asdict(rl))) == dataclasses.asdict(rl)  # workers compare it after JSON
