"""The trainer's request (train/request.py) carries the run's own rl.* and train.* keys, declared
once (train/settings.py): the run config's sections derive from the same dataclasses, so both
refuse the same values with the same key names, and a bad value fails at `orchestrator run`,
not in the trainer."""

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import config
from orchestrator.errors import ConfigError
from orchestrator.train import request as train_request
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.request import TrainRequest
from orchestrator.train.settings import TrainerSettings, UpdateSettings

GOOD = {
    "iteration": 1,
    "data": "/run/iterations/1/train.jsonl",
    "init_checkpoint": "/run/checkpoints/0",
    "reference_checkpoint": None,
    "output": "/run/checkpoints/1.staging",
    "seed": 7,
    "rl": {"lr": 3e-4, "epochs": 2, "micro_batch": 2, "clip_eps": 0.2, "kl_coef": 0, "max_grad_norm": 1},
}
TOP = ("iteration", "data", "init_checkpoint", "reference_checkpoint", "output", "seed")


def _with(**over) -> dict:
    """GOOD with ``over`` set: a top-level key as it is, an rl.* or train.* key in its section."""
    raw = {**GOOD, "rl": dict(GOOD["rl"]), "train": {}}
    for key, value in over.items():
        section = next((name for name, cls in train_request.SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}), None)
        (raw[section] if section else raw)[key] = value
    return raw


def _named(key: str) -> str:
    section = next((name for name, cls in train_request.SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}), None)
    return f"{section}.{key}" if section else key


def _error(**over) -> str:
    with pytest.raises(ValueError) as raised:
        TrainRequest.from_json(_with(**over))
    return str(raised.value)


def test_a_good_request_decodes_with_paths_as_paths_and_ints_as_floats():
    c = TrainRequest.from_json(GOOD)
    assert c.data == Path(GOOD["data"]) and c.reference_checkpoint is None
    assert c.rl.kl_coef == 0.0 and isinstance(c.rl.kl_coef, float) and isinstance(c.rl.max_grad_norm, float)
    assert c.train == TrainerSettings() and not c.uses_kl


def test_what_the_rank_writes_from_the_default_run_config_decodes_to_the_same_settings():
    """The sections as workloads/rl/workload.py's _trainer_config writes them: every field of
    the run's rl and train sections that the trainer's settings declare."""
    rl, train = config.RLConfig(), config.TrainPlacementConfig()
    written = {**GOOD, "rl": {f.name: getattr(rl, f.name) for f in dataclasses.fields(UpdateSettings)},
               "train": {f.name: getattr(train, f.name) for f in dataclasses.fields(TrainerSettings)}}
    c = TrainRequest.from_json(written)
    assert dataclasses.asdict(c.rl) == {f.name: getattr(rl, f.name) for f in dataclasses.fields(UpdateSettings)}
    assert dataclasses.asdict(c.train) == {f.name: getattr(train, f.name) for f in dataclasses.fields(TrainerSettings)}


def test_the_run_config_sections_are_the_trainer_settings():
    assert issubclass(config.RLConfig, UpdateSettings) and issubclass(config.TrainPlacementConfig, TrainerSettings)


def test_missing_keys_are_all_named():
    with pytest.raises(ValueError, match="lacks data, seed"):
        TrainRequest.from_json({k: v for k, v in GOOD.items() if k not in ("data", "seed")})


@pytest.mark.parametrize("key,value,message", [
    ("lr", "0.1", "Expected `float`, got `str`"),
    ("epochs", 1.5, "Expected `int`, got `float`"),
    ("data", 5, "Expected `str`, got `int`"),
    ("reference_checkpoint", ["/a"], "Expected `str`, got `list`"),
    ("seed", None, "Expected `int`, got `null`"),
    ("strategy", "zero3", "Expected `str` matching regex"),
])
def test_a_value_of_the_wrong_type_is_named_by_its_key(key, value, message):
    assert _error(**{key: value}).startswith(f"train request key {_named(key)!r} is {value!r}: {message}")


@pytest.mark.parametrize("key", ["iteration", "seed", "epochs", "micro_batch", "lr", "kl_coef"])
def test_a_bool_is_not_a_number(key):
    assert f"train request key {_named(key)!r} is True: Expected" in _error(**{key: True})


@pytest.mark.parametrize("key,value,bound", [
    ("lr", -1, "> 0.0"), ("lr", 0, "> 0.0"), ("clip_eps", 0.0, "> 0.0"), ("max_grad_norm", float("nan"), "> 0.0"),
    ("kl_coef", -0.1, ">= 0.0"), ("epochs", 0, ">= 1"), ("micro_batch", 0, ">= 1"), ("iteration", -1, ">= 0"),
    ("micro_batch_tokens", -1, ">= 0"), ("lora_dropout", 1.0, "< 1.0"),
])
def test_a_value_out_of_bounds_is_named(key, value, bound):
    assert _error(**{key: value}).startswith(f"train request key {_named(key)!r} is {value!r}: Expected `")
    assert _error(**{key: value}).endswith(bound)


@pytest.mark.parametrize("key", ["data", "init_checkpoint", "reference_checkpoint", "output"])
def test_paths_must_be_absolute(key):
    assert _error(**{key: "relative/dir"}) == f"train request key {key!r} is 'relative/dir': must be an absolute path"


def test_the_rules_between_keys_are_the_run_configs():
    assert "rl.overlong_buffer=5 is longer than rl.max_tokens=4" in _error(overlong_buffer=5, max_tokens=4)
    with pytest.raises(ConfigError, match="rl.overlong_buffer=5 is longer than rl.max_tokens=4"):
        config.RLConfig(overlong_buffer=5, max_tokens=4)
    assert "train.lora_rank > 0 needs base_model" in _error(lora_rank=8)


def test_unknown_keys_are_logged_and_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.train.request"):
        c = TrainRequest.from_json({**_with(), "zeta": 1, "alpha": 2, "rl": {**GOOD["rl"], "beta": 3}})
    assert c == TrainRequest.from_json(GOOD)
    assert "ignoring unknown train request keys: alpha, zeta" in caplog.text
    assert "ignoring unknown train request keys: rl.beta" in caplog.text


def test_not_an_object():
    with pytest.raises(ValueError, match="not a JSON object"):
        TrainRequest.from_json([GOOD])
    with pytest.raises(ValueError, match="'rl' is not an object"):
        TrainRequest.from_json({**GOOD, "rl": [1]})


def test_read_raises_bad_train_input_naming_the_file_and_the_key(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('{"seed": -1}')
    with pytest.raises(BadTrainInput, match=f"train request {path}: the train request lacks iteration, "):
        TrainRequest.read(path)
    path.write_text("{")
    with pytest.raises(BadTrainInput, match=f"train request {path}: "):
        TrainRequest.read(path)


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
def test_both_refuse_the_same_values(key, value):
    with pytest.raises(ConfigError, match=f"rl.{key} must be"):
        config.RLConfig(**{key: value})
    with pytest.raises(ValueError, match=f"train request key 'rl.{key}'"):
        TrainRequest.from_json(_with(**{key: value}))


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
