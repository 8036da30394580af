"""A data folder names the reward and environment its tasks need (demo.json's run_keys): a
run takes them unless its command line sets them, and every rank reaches the same ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator import preflight
from orchestrator.cli import run_options
from orchestrator.data import run_keys
from orchestrator.errors import ConfigError
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.join import config_mismatch
from orchestrator.protocol.layout import RunLayout

MATH = "orchestrator.rewards:math"
CALCULATOR = "orchestrator.demo.calculator:Calculator"


@pytest.fixture(autouse=True)
def no_node_checks(monkeypatch):
    """These folders hold no model or tasks: what is checked here is the config alone."""
    monkeypatch.setattr(preflight, "check", lambda config: None)
    monkeypatch.setattr("orchestrator.config.base_model.identity", lambda path: {"model": "the same files"})


def _params(data: Path, *overrides: str, rehearsal: bool = False) -> dict:
    return {"data_path": data, "log_path": data.parent / "run", "rl_phase": "both", "num_nodes": 1, "rank_weights": None,
            "eval_interval": 1, "rollout_split": None, "max_iterations": 2, "rehearsal": rehearsal, "debug_mode": False,
            "engine": None, "overrides": overrides}


def _folder(tmp_path: Path, keys: dict | None) -> Path:
    data = tmp_path / "data"
    data.mkdir(parents=True)
    if keys is not None:
        (data / "demo.json").write_text(json.dumps({"seed": 0, run_keys.FIELD: keys}))
    return data


def test_a_run_takes_the_reward_and_environment_its_data_folder_names(tmp_path):
    data = _folder(tmp_path, {"rl.reward": MATH, "rl.environment": CALCULATOR})
    config = run_options.build_config(_params(data), rank=0)
    assert (config.rl.reward, config.rl.environment) == (MATH, CALCULATOR)
    assert config.keys_from_data == (f"rl.reward={MATH}", f"rl.environment={CALCULATOR}")
    assert config.fingerprint()["rl"]["reward"] == MATH


def test_a_key_on_the_command_line_wins_over_the_data_folder(tmp_path):
    data = _folder(tmp_path, {"rl.reward": MATH, "rl.environment": CALCULATOR})
    config = run_options.build_config(_params(data, "rl.reward=orchestrator.rewards:exact_match", "rl.environment="), rank=0)
    assert (config.rl.reward, config.rl.environment) == ("orchestrator.rewards:exact_match", "")
    assert config.keys_from_data == ()


def test_an_agent_on_the_command_line_stands_for_the_folders_environment(tmp_path):
    data = _folder(tmp_path, {"rl.reward": MATH, "rl.environment": CALCULATOR})
    config = run_options.build_config(_params(data, "rl.agent=orchestrator.rewards:math"), rank=0)  # any module:function parses
    assert (config.rl.reward, config.rl.environment, config.rl.agent) == (MATH, "", "orchestrator.rewards:math")
    assert config.keys_from_data == (f"rl.reward={MATH}",)


def test_a_folder_without_run_keys_keeps_the_defaults(tmp_path):
    config = run_options.build_config(_params(_folder(tmp_path, None)), rank=0)
    assert (config.rl.reward, config.rl.environment, config.keys_from_data) == ("orchestrator.rewards:exact_match", "", ())


def test_a_rank_whose_folder_names_another_reward_is_a_fingerprint_mismatch(tmp_path):
    master = run_options.build_config(_params(_folder(tmp_path / "a", {"rl.reward": MATH})), rank=0)
    worker = run_options.build_config(_params(_folder(tmp_path / "b", None)), rank=0)
    mismatch = config_mismatch(master.fingerprint(), {1: {"fingerprint": worker.fingerprint()}})
    assert mismatch is not None and MATH in mismatch[1]


def test_a_data_folder_names_no_training_keys(tmp_path):
    data = _folder(tmp_path, {"rl.lr": "1e-3"})
    with pytest.raises(ConfigError, match="names only rl.reward and rl.environment"):
        run_options.build_config(_params(data), rank=0)


def test_demo_data_names_what_each_demo_needs_even_in_a_folder_made_before(tmp_path):
    from orchestrator.demo import build

    assert build.run_keys_of() == {"rl.reward": "orchestrator.rewards:exact_match"}
    assert build.run_keys_of(chat=True) == {"rl.reward": MATH}
    assert build.run_keys_of(tools=True) == {"rl.reward": MATH, "rl.environment": CALCULATOR}
    data = tmp_path / "data"  # a chat demo made before demo.json named its keys: not remade, its demo.json completed
    (data / "model").mkdir(parents=True)
    (data / "model" / "model.safetensors").write_bytes(b"")
    (data / "demo.json").write_text(json.dumps({"seed": 0, "settings": {"seed": 0, "warm_steps_fixed": 0, "chat": True}}))
    assert build.build(data, warm_steps=0, chat=True)[run_keys.FIELD] == {"rl.reward": MATH}
    assert run_keys.read(data) == {"rl.reward": MATH}


def _stopped_at(config, phase: int) -> None:
    """The run of ``config`` as if stopped in iteration 1 past ``phase`` (0: before its rollout)."""
    layout = RunLayout(config.log_path)
    fsio.write_record(layout.progress, {"attempt": "a000001-x", "iteration": 1, "phase": phase, "training": []})
    fsio.write_record(layout.attempt("a000001-x").start, {"fingerprint": config.fingerprint()})


def test_a_run_resumed_inside_its_rollout_keeps_the_reward_it_started_it_with_whichever_the_folder_names_now(tmp_path):
    data = _folder(tmp_path, {})
    started = run_options.build_config(_params(data), rank=0)  # a folder made before demo.json named its reward
    _stopped_at(started, Phase.SYNC_START)
    (data / "demo.json").write_text(json.dumps({"seed": 0, run_keys.FIELD: {"rl.reward": MATH}}))  # demo-data completed it
    with pytest.raises(ConfigError, match=r"is inside iteration 1, before phase 1:rollout .*; rl.reward='orchestrator.rewards:math' "
                                          r"would grade the rest of that iteration's samples otherwise .* resume with "
                                          r"rl.reward='orchestrator.rewards:exact_match'"):
        preflight.check_resume(run_options.build_config(_params(data), rank=0))
    preflight.check_resume(run_options.build_config(_params(data, "rl.reward=orchestrator.rewards:exact_match"), rank=0))
    _stopped_at(started, Phase.SYNC_END)  # between iterations: the next one takes the folder's
    resumed = run_options.build_config(_params(data), rank=0)
    preflight.check_resume(resumed)
    assert resumed.rl.reward == MATH and resumed.keys_from_data == (f"rl.reward={MATH}",)
