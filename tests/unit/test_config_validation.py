"""The run config's one validation path: each field's bounds are msgspec constraints on its
type, checked by one walk in every section, and the `section.key=value` overrides take their
keys and types from the same dataclasses. The messages are the ones users and
tests/system/test_bad_input.py rely on, word for word."""

import dataclasses
import math
import re
import typing
from pathlib import Path

import msgspec
import pytest

from orchestrator import config
from orchestrator.train import settings
from orchestrator.errors import ConfigError
from orchestrator.phase_table import RLPhase


def _build(*overrides: str) -> dict:
    return config.build_sections(config.parse_overrides(overrides))


def _error(*overrides: str) -> str:
    """The message of the ConfigError that building sections from ``overrides`` raises."""
    with pytest.raises(ConfigError) as raised:
        _build(*overrides)
    return str(raised.value)


def _run(**fields) -> config.RunConfig:
    return config.RunConfig(data_path=Path("/data"), log_path=Path("/run"), rl_phase=RLPhase.BOTH, eval_interval=1, rank=0,
                            **{"workload": config.WorkloadKind.REHEARSAL, **fields})


BOUNDS = {
    "coordination seconds": ("coordination.node_timeout_s=0", "coordination.node_timeout_s must be a positive number of seconds, got 0.0"),
    "coordination optional": ("coordination.master_wait_s=-2", "coordination.master_wait_s must be >= 0 seconds, got -2.0"),
    "coordination count": ("coordination.min_nodes=0", "coordination.min_nodes must be at least 1, got 0"),
    "coordination chunk": ("coordination.chunk_tasks=-1", "coordination.chunk_tasks must be >= 0 (0: automatic), got -1"),
    "deadlines": ("deadlines.train=-5", "deadlines.train must be a positive number of seconds, got -5.0"),
    "rehearsal pair": ("rehearsal.eval_tasks=0", "rehearsal.tasks and rehearsal.eval_tasks must be at least 1, got 24, 0"),
    "rehearsal non-negative": ("rehearsal.record_bytes=-1", "rehearsal.record_bytes must be >= 0, got -1"),
    "rl count": ("rl.samples_per_prompt=0", "rl.samples_per_prompt must be at least 1, got 0"),
    "rl trainer bound": ("rl.lr=-1", "rl.lr must be > 0, got -1.0"),
    "rl interval": ("rl.top_p=1.5", "rl.top_p must be in (0, 1], got 1.5"),
    "rl closed interval": ("rl.max_reward_error_fraction=2", "rl.max_reward_error_fraction must be in [0, 1], got 2.0"),
    "rl pair": ("rl.eval_temperature=-1", "rl.temperature and rl.eval_temperature must be >= 0"),
    "rl list": ('rl.stop=["a", ""]', "rl.stop must be non-empty strings, got ['a', '']"),
    "rl step rewards": ("rl.step_rewards=mean", "rl.step_rewards='mean': valid rl.step_rewards values are sum, last"),
    "rl aggregation": ("rl.loss_agg=seq_sum", "rl.loss_agg='seq_sum': valid aggregations are token_mean, seq_mean_token_sum, seq_mean_token_mean"),
    "rl ratio level": ("rl.ratio_level=group", "rl.ratio_level='group': valid levels are token, sequence"),
    "rl overlong": ("rl.overlong=drop", "rl.overlong='drop': valid choices are keep, mask, penalty"),
    "rl overlong buffer": ("rl.overlong_buffer=9", "rl.overlong_buffer=9 is longer than rl.max_tokens=8: the penalty ramps over "
                           "the last rl.overlong_buffer tokens of a completion; set it at most rl.max_tokens"),
    "tracking": ("tracking.backends=tensorboard,swanlab", "tracking.backends names 'swanlab': the backends are tensorboard, wandb, "
                 "mlflow, e.g. tracking.backends=tensorboard,wandb"),
    "data": ("data.id_key=", "data.id_key must not be empty"),
    "train choice": ("train.strategy=zero", "train.strategy='zero': valid strategies are ddp, fsdp"),
    "train trainer bound": ("train.micro_batch_tokens=-1", "train.micro_batch_tokens must be >= 0 (0: no limit), got -1"),
    "lora rank": ("train.lora_rank=-4", "train.lora_rank must be >= 0 (0: no LoRA, the whole model is trained), got -4"),
    "lora dropout": ("train.lora_dropout=1", "train.lora_dropout must be in [0, 1), got 1.0"),
    "lora modules": ("train.lora_target_modules=,", "train.lora_target_modules is empty: name the modules that get an adapter, "
                     "e.g. train.lora_target_modules=q_proj,v_proj, or all-linear"),
    "rollout choice": ("rollout.engine=sglang", "rollout.engine='sglang': valid engines are embedded, vllm"),
    "rollout port": ("rollout.engine_port=70000", "rollout.engine_port must be a TCP port (0-65535), got 70000"),
    "rollout timeout": ("rollout.memory_release_timeout_s=0", "rollout.memory_release_timeout_s must be a positive number of seconds"),
    "rollout interval": ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization must be in (0, 1], got 0.0"),
    "rollout oversample": ("rollout.oversample=1.5", "rollout.oversample must be in (0, 1], got 1.5"),
    "rollout carry": ("rollout.max_carry=0", "rollout.max_carry must be >= 1, got 0"),
    "checkpoint": ("checkpoint.keep_last=0", "checkpoint.keep_last must be at least 1 (the current checkpoint is always kept), got 0"),
}


@pytest.mark.parametrize("override,message", BOUNDS.values(), ids=BOUNDS.keys())
def test_a_bound_violated_in_any_section_names_the_key_and_the_value(override, message):
    assert _error(override) == message


@pytest.mark.parametrize("fields,message", [
    ({"num_nodes": 0, "rank_weights": None}, "--num-nodes must be at least 1, got 0"),
    ({"eval_interval": 0}, "--eval-interval must be at least 1, got 0"),
    ({"max_iterations": -1}, "--max-iterations must be at least 1, got -1"),
])
def test_the_top_level_bounds_name_the_flag(fields, message):
    base = {"eval_interval": 1, **fields}
    with pytest.raises(ConfigError) as raised:
        config.RunConfig(data_path=Path("/data"), log_path=Path("/run"), rl_phase=RLPhase.BOTH, rank=0,
                         workload=config.WorkloadKind.REHEARSAL, **base)
    assert str(raised.value) == message


def _bounded_keys():
    """``(key, value just past a bound)`` for every numeric bound of every section's fields."""
    for section, cls in config._section_classes().items():
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in dataclasses.fields(cls):
            meta = config._meta(hints[f.name])
            if meta is None:
                continue
            for past in (meta.ge - 1 if meta.ge is not None else None, meta.gt, meta.le + 1 if meta.le is not None else None, meta.lt):
                if past is not None:
                    yield f"{section}.{f.name}", past


@pytest.mark.parametrize("key,value", list(_bounded_keys()))
def test_every_bounded_key_refuses_a_value_past_its_bound_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"\b{key}\b"):
        _build(f"{key}={value}")


@pytest.mark.parametrize("key", ["coordination.node_timeout_s", "deadlines.rollout", "rl.top_p", "rehearsal.work_s"])
def test_nan_is_outside_every_bound(key):
    with pytest.raises(ConfigError, match=rf"\b{key}\b"):
        _build(f"{key}=nan")


@pytest.mark.parametrize("override,section,name,value", [
    ("coordination.chunk_tasks=+5", "coordination", "chunk_tasks", 5),
    ("rehearsal.record_bytes=1_000", "rehearsal", "record_bytes", 1000),
    ("rollout.gpu_memory_utilization=.5", "rollout", "gpu_memory_utilization", 0.5),
    ("coordination.node_timeout_s=30", "coordination", "node_timeout_s", 30.0),
    ("coordination.master_wait_s=12.5", "coordination", "master_wait_s", 12.5),
    ("coordination.elastic=yes", "coordination", "elastic", True),
    ("coordination.work_stealing=Off", "coordination", "work_stealing", False),
    ("train.keep_alive=0", "train", "keep_alive", False),
    ("rl.train_on_partial=TRUE", "rl", "train_on_partial", True),
    ("rollout.engine_args= --enforce-eager ", "rollout", "engine_args", "--enforce-eager"),
    ('rl.stop=["</answer>", "\\n"]', "rl", "stop", ["</answer>", "\n"]),
    ("rl.stop=</s>", "rl", "stop", ["</s>"]),
    ('rl.environment_args={"db_path": "/data", "level": 3}', "rl", "environment_args", {"db_path": "/data", "level": 3}),
    ("rl.environment_args=", "rl", "environment_args", {}),
    ("tracking.backends=tensorboard, mlflow", "tracking", "backends", ["tensorboard", "mlflow"]),
    ('tracking.backends=["wandb"]', "tracking", "backends", ["wandb"]),
])
def test_an_override_of_each_type_converts(override, section, name, value):
    got = getattr(_build(override)[section], name)
    assert got == value and type(got) is type(value)


def test_the_top_level_override_converts_and_lands_outside_the_sections():
    parsed = config.parse_overrides(["seed=42"])
    assert parsed["top"] == {"seed": 42}
    assert _build("seed=42")["seed"] == 42


@pytest.mark.parametrize("override,message", [
    ("coordination.node_timeout_s=soon", "coordination.node_timeout_s='soon': expected a value of type float"),
    ("rl.epochs=5.0", "rl.epochs='5.0': expected a value of type int"),
    ("coordination.elastic=maybe", "coordination.elastic='maybe': expected a value of type bool"),
    ("seed=x", "seed='x': expected a value of type int"),
    ("rl.stop=[1, 2]", "rl.stop='[1, 2]': expected a JSON list of strings, e.g. rl.stop='[\"a\", \"b\"]', or one string"),
    ("rl.environment_args=[1]", "rl.environment_args='[1]': expected a JSON object, e.g. rl.environment_args='{\"name\": 1}'"),
    ("rl.environment_args=level=3", "rl.environment_args='level=3': expected a JSON object, e.g. rl.environment_args='{\"name\": 1}'"),
])
def test_a_value_of_the_wrong_type_names_the_key(override, message):
    assert _error(override) == message


def test_an_unknown_key_names_the_closest_keys_and_the_config_command():
    assert _error("rl.lrr=1") == "unknown config key 'rl.lrr': did you mean rl.lr, rl.reward or rl.eval_reward? (`orchestrator config` lists every key)"
    assert _error("coordination.nope=1") == ("unknown config key 'coordination.nope': did you mean coordination.min_nodes, "
                                             "coordination.fan_in or coordination.elastic? (`orchestrator config` lists every key)")


def test_a_key_without_its_section_is_found_by_its_name():
    assert _error("lr=1e-5") == "unknown config key 'lr': did you mean rl.lr? (`orchestrator config` lists every key)"
    assert "did you mean rl.temperature, judge.temperature or rl.eval_temperature?" in _error("temperature=0")


def test_an_unknown_key_with_nothing_close_points_to_its_section_or_to_every_key():
    assert _error("rl.learning_rate=1") == "unknown config key 'rl.learning_rate': rl has no such key: `orchestrator config rl` lists its keys"
    message = _error("nosuch.thing=1")
    assert message.startswith("unknown config key 'nosuch.thing': keys are SECTION.NAME (or seed) with sections coordination, ")
    assert message.endswith("; `orchestrator config` lists every key")


def test_a_missing_value_says_how_to_give_one_without_listing_every_key():
    assert _error("rl.lr") == ("override 'rl.lr' is not key=value: give rl.lr=VALUE "
                               "(`orchestrator config rl.lr` shows its type and default)")
    assert _error("--lr") == "override '--lr' is not key=value, e.g. rl.lr=1e-5 (`orchestrator config` lists every key)"


def test_the_valid_keys_are_the_fields_of_every_section_in_order():
    keys = config.valid_override_keys()
    assert keys[:2] == ["seed", "coordination.heartbeat_interval_s"]
    sections = [f.name for f in dataclasses.fields(config.RunConfig) if dataclasses.is_dataclass(f.default_factory)]
    assert sections == ["coordination", "deadlines", "rehearsal", "model", "rl", "data", "train", "rollout", "checkpoint", "publish", "tracking", "judge"]
    expected = ["seed"] + [f"{s}.{f.name}" for s in sections for f in dataclasses.fields(getattr(_run(), s))]
    expected += [f"models.<name>.{f.name}" for f in dataclasses.fields(config.AuxModelConfig)]  # a section per named model
    assert keys == expected


def test_rules_between_fields_still_apply_after_the_bounds():
    with pytest.raises(ConfigError, match="must not exceed poll_max_s"):
        _build("coordination.poll_min_s=1", "coordination.poll_max_s=0.5")
    with pytest.raises(ConfigError, match="does not divide rollout.gpus_per_engine=4"):
        _build("rollout.gpus_per_engine=4", "rollout.pipeline_parallel_size=3")
    with pytest.raises(ConfigError, match="exceeds --num-nodes 1"):
        _run(coordination=config.CoordinationConfig(min_nodes=2))
    with pytest.raises(ConfigError, match="rollout.partial=true does not continue samples of rl.filter_groups, and rl.filter_groups="):
        _run(workload=config.WorkloadKind.RL, rl=config.RLConfig(filter_groups=True), rollout=config.RolloutConfig(partial=True))
    _run(workload=config.WorkloadKind.RL, rl=config.RLConfig(agent="m:agent"), rollout=config.RolloutConfig(partial=True))


def test_the_trainer_types_keep_their_msgspec_bounds():
    """train/request.py decodes with these; the error template a field carries changes nothing there."""
    for hint, bad, good in [(settings.LearningRate, 0.0, 1e-4), (settings.Epochs, 0, 1), (settings.MicroBatchTokens, -1, 0),
                            (settings.MaxGradNorm, math.nan, 1.0), (settings.KLCoef, -0.1, 0.0)]:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, hint)
        assert msgspec.convert(good, hint) == good


@pytest.mark.parametrize("overrides, message", [
    (["models.teacher.pth=/m"], "unknown config key 'models.teacher.pth': did you mean models.<name>.path"),
    (["models.<name>.path=/m"], "models.<name>: a model's name is a letter then letters, digits, - or _"),
    (["models.policy.path=/m"], "models.policy: a model's name is a letter"),
    (["models.teacher.path="], "models.teacher has no path: set models.teacher.path="),
    (["rl.teacher=t", "rl.distill_coef=1"], "rl.teacher=t names no model: no models.<name>.path is set; set models.t.path="),
    (["models.a.path=/m", "rl.teacher=t", "rl.distill_coef=1"], "rl.teacher=t names no model: the models are a;"),
    (["models.t.path=/m", "rl.teacher=t"], "rl.teacher=t needs rl.distill_coef > 0"),
    (["rl.distill_coef=1"], "rl.distill_coef=1 needs a teacher: set rl.teacher=<name> and models.<name>.path"),
    (["models.t.path=/m", "train.device_mapping=0", "rollout.device_mapping=0"],
     "models.t needs GPUs of its own in a GPU run: set models.t.device_mapping"),
    (["models.t.path=/m", "models.t.device_mapping=1", "train.device_mapping=0-1", "rollout.device_mapping=0-1"],
     "models.t.device_mapping=1 shares GPU 1 with train.device_mapping: a model beside the policy holds its GPUs"),
    (["models.t.path=/m", "models.t.device_mapping=2", "models.u.path=/m", "models.u.device_mapping=2-3", "train.device_mapping=0",
      "rollout.device_mapping=1"], "models.u.device_mapping and models.t.device_mapping both use GPU 2"),
    (["models.t.path=/m", "models.t.nodes=0", "models.t.device_mapping=2", "train.device_mapping=0", "rollout.device_mapping=1"],
     "models.t.nodes chooses the nodes that serve models.t on CPU; on GPUs models.t.device_mapping places it"),
    (["models.t.path=/m", "models.t.device_mapping=1"], "models.t.device_mapping=1 places models.t on GPUs, but this run is on CPU"),
    (["models.t.path=/m", "models.t.nodes=3"], "models.t.nodes names node 3, but the run has 1 node(s): 0-0"),
    (["models.t.path=/m", "models.t.nodes=a"], "models.t.nodes='a': 'a' is not a node rank"),
    (["rl.reward=orchestrator.rewards:judge"], "rl.reward=orchestrator.rewards:judge asks a judge model: set judge.model=<name> and models."),
    (["rl.eval_reward=orchestrator.rewards:judge", "judge.model=j"], "judge.model=j names no model: no models.<name>.path is set; set models.j.path="),
    (["models.j.path=/m", "judge.model=j"], "judge.model=j is set but no reward asks it: set rl.reward=orchestrator.rewards:judge"),
    (["models.j.path=/m", "judge.model=j", "rl.reward=orchestrator.rewards:judge", "rl.environment=m:Env"],
     "rl.reward=orchestrator.rewards:judge judges single-turn completions, and rl.environment=m:Env is set"),
    (["judge.parse=score10"], "judge.parse='score10': valid judge.parse values are verdict, score"),
    (["judge.max_tokens=0"], "judge.max_tokens must be >= 1, got 0"),
    (["judge.temperature=-1"], "judge.temperature must be >= 0, got -1.0"),
    (["rl.eval_reward=math"], "rl.eval_reward='math' is not of the form module:function"),
])
def test_models_beside_the_policy_and_a_teacher_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _run(workload=config.WorkloadKind.RL, **_build(*overrides))
    assert _run(workload=config.WorkloadKind.RL, **_build("models.t.path=/m", "rl.teacher=t", "rl.distill_coef=1")).models["t"].path == "/m"
    judged = _run(workload=config.WorkloadKind.RL, **_build("models.j.path=/m", "judge.model=j", "rl.reward=orchestrator.rewards:judge"))
    assert judged.judge.model == "j" and judged.judge.parse == "verdict"


def test_the_judges_template_file_is_read_and_checked_naming_the_key(tmp_path):
    from orchestrator.plugins import judge

    def template(**fields):
        return config.RunConfig(data_path=tmp_path, log_path=Path("/run"), rl_phase=RLPhase.BOTH, eval_interval=1, rank=0, **_build("models.j.path=/m", "judge.model=j", "rl.reward=orchestrator.rewards:judge",
                                                        *(f"judge.{k}={v}" for k, v in fields.items()))).judge_template()

    assert template() == judge.DEFAULT_TEMPLATE
    (tmp_path / "t.txt").write_text("Q {question} A {completion} {task[level]} {{x}}")
    assert template(template="t.txt") == "Q {question} A {completion} {task[level]} {{x}}"
    with pytest.raises(ConfigError, match=re.escape(f"judge.template=none.txt: cannot read {tmp_path}/none.txt")):
        template(template="none.txt")
    for text, message in [("{reply} {completion}", "{reply} is not a field of the judge's template"),
                          ("{} {completion}", "{} is not a field"), ("{question", "not a template"),
                          ("{question} {answer}", "the template never shows the judge the completion")]:
        (tmp_path / "bad.txt").write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            template(template="bad.txt")
