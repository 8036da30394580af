"""A run's config against this node: what ``config.py`` cannot check from the values alone.

``RunConfig`` validates values (ranges, combinations, mapping syntax): the same on every
node. These checks look at the node itself (the base model ``model.path`` names, the task
files, every row of them and the length of every prompt, whether the reward module and vLLM
import here), so a config that passes on one node can fail here on another. Both run before
anything is written; a failure is a ConfigError (exit 2).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from orchestrator.plugins import agents, environments, rewards
from orchestrator.config import RunConfig, WorkloadKind
from orchestrator.data import prompts, run_keys, shards, tasks
from orchestrator.errors import ConfigError
from orchestrator.node import base_model
from orchestrator.phase_table import Phase
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout

# What decides an iteration's tasks: changed inside an iteration, the plan, the claims and the
# shards written so far would describe other tasks. (Node counts and weights may change: the
# unfinished work is split again over the ranks of the new run, data/claims.py.)
_TASK_KEYS = {"seed": ("seed",), "workload": ("workload",), "rehearsal.tasks": ("rehearsal", "tasks"),
              "rehearsal.eval_tasks": ("rehearsal", "eval_tasks"), "rl.train_tasks": ("rl", "train_tasks"),
              "rl.eval_tasks": ("rl", "eval_tasks"), "data.train_file": ("data", "train_file"), "data.test_file": ("data", "test_file"),
              "rollout.partial": ("rollout", "partial"), "rollout.oversample": ("rollout", "oversample")}
_GRADING_KEYS = {"rl.reward": ("rl", "reward"), "rl.environment": ("rl", "environment"), "rl.agent": ("rl", "agent"),
                 "rl.environment_args": ("rl", "environment_args"), "rl.step_rewards": ("rl", "step_rewards"),
                 "rl.eval_reward": ("rl", "eval_reward")} | {
                     f"judge.{k}": ("judge", k) for k in ("model", "template", "parse", "max_score", "max_tokens", "temperature")}
"""What scores an iteration's samples: a rollout resumed under another would grade its samples
two ways (the value may come from the data folder's demo.json, data/run_keys.py)."""


def check(config: RunConfig) -> None:
    """Raise ConfigError naming what this node lacks for ``config``; an OSError on one of the
    user's paths (a file it cannot read, a directory it cannot list) is one too."""
    try:
        _check(config)
    except OSError as e:
        raise ConfigError(f"{os_error_line(e)}: this node must read what --data-path and the config name and write --log-path; "
                          f"fix the path or its permissions") from None


def _check(config: RunConfig) -> None:
    check_log_path(config.log_path)
    check_resume(config)
    try:
        rewards.load(config.rl.reward)
        if config.rl.eval_reward:
            rewards.load(config.rl.eval_reward, "rl.eval_reward")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.workload is not WorkloadKind.RL:
        return
    if config.rollout.engine == "vllm" and not config.debug_mode and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm but vLLM is not installed in this Python: pip install 'orchestrator[vllm]' "
            "on a GPU node, or run scripts/setup-vllm.sh for vLLM on CPU"
        )
    model = config.model_path  # a hub id the local Hugging Face cache lacks: ConfigError
    missing = [config.task_file(split) for split in ("train", "eval") if not tasks.generated(config, split) and not config.task_file(split).is_file()]
    if not config.model.path and not (model / "config.json").is_file():
        missing.insert(0, model / "config.json")  # no demo data: the message below says how to make it
    else:
        base_model.check(model, config.model.path)
    if missing:
        raise ConfigError(_missing_data(config, missing))
    task_lists = [tasks.read(tasks.for_split(config, split)) for split in ("train", "eval")]
    if tasks.needs_chat_template(task_lists, config.data.system_prompt) and not has_chat_template(model):
        why = "data.system_prompt is set" if config.data.system_prompt else "the prompts are chat messages"
        raise ConfigError(f"{why}, but the model {model} has no chat template "
                          f"(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    for split in ("train", "eval"):
        prompts.measure(config, split)  # every prompt rendered and counted against rl.max_prompt_tokens
    if config.rl.environment:
        check_environment(config)
    if config.rl.agent:
        check_agent(config)
    if config.train.lora_rank:
        check_lora_targets(model, config.train.lora_target_modules)
    check_models(config)


def check_models(config: RunConfig) -> None:
    """Each ``models.<name>`` is a model directory this node reads; a teacher's tokenizer is the
    policy's (its log-probs are of the ids the policy sampled, sent as they are); a judge's
    template (judge.template) reads as one."""
    for name, aux in config.models.items():
        base_model.check(config.aux_model_path(name), aux.path, f"models.{name}.path")
    if config.judge.model:
        config.judge_template()  # read and checked: ConfigError
    if config.rl.teacher:
        from transformers import AutoTokenizer

        policy, teacher = (AutoTokenizer.from_pretrained(str(p)) for p in (config.model_path, config.aux_model_path(config.rl.teacher)))
        if policy.get_vocab() != teacher.get_vocab() or policy.all_special_ids != teacher.all_special_ids:
            raise ConfigError(f"rl.teacher={config.rl.teacher}: the model {config.aux_model_path(config.rl.teacher)} has another "
                              f"tokenizer than the policy's ({config.model_path}): a teacher scores the policy's own token ids, "
                              f"so both must share one tokenizer (the same vocabulary and special tokens)")


def check_lora_targets(model: Path, targets: list[str]) -> None:
    """Every module train.lora_target_modules names is one of the base model's (built on the
    meta device from its config.json: no weights read), so that a typo stops the run here and
    not in its first update."""
    if list(targets) == ["all-linear"]:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        names = {name.rsplit(".", 1)[-1] for name, _ in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).named_modules()}
    unknown = [t for t in targets if t not in names]
    if unknown:
        linear = sorted({n for n in names if n.endswith("_proj")})
        raise ConfigError(f"train.lora_target_modules names {', '.join(unknown)}, which the model {model} has no module of"
                          + (f"; its projections are {', '.join(linear)}" if linear else "") + " (or all-linear)")


def _missing_data(config: RunConfig, missing: list[Path]) -> str:
    """What to do about missing task files or model: in an empty or absent --data-path, or a
    demo's folder (its demo.json), make the demo data there; in a folder of the user's own, the
    key that names each file (the demo data would be written among their files)."""
    data = Path(config.data_path)
    if not data.is_dir() or not any(data.iterdir()) or run_keys.path(data).is_file():
        return (f"--data-path {data} lacks {', '.join(map(str, missing))}: make the demo data with "
                f"`orchestrator demo-data --data-path {data}`, or add --rehearsal for simulated work")
    key_of = {config.task_file("train"): f"data.train_file={config.data.train_file}",
              config.task_file("eval"): f"data.test_file={config.data.test_file}",
              config.model_path / "config.json": "model.path (unset: <data-path>/model)"}
    named = "; ".join(f"{p} (from {key_of[p]})" for p in missing)
    return (f"--data-path {data} lacks {named}: set the key to your file (data.train_file and data.test_file: a path under "
            f"--data-path, or absolute; model.path: a model directory or a Hugging Face id; docs/data.md)")


def check_environment(config: RunConfig) -> None:
    """rl.environment imports here, and the model's chat template can render its turns: a
    multi-turn rollout sends token ids the template renders (data/turns.py)."""
    try:
        cls = environments.load(config.rl.environment)
        environments.arguments(cls, {}, args=config.rl.environment_args, max_turns=config.rl.max_turns)
    except ValueError as e:
        raise ConfigError(f"rl.environment={config.rl.environment}: {e}" if "rl.environment=" not in str(e) else str(e)) from None
    model = config.model_path
    if not has_chat_template(model):
        raise ConfigError(f"rl.environment={config.rl.environment} needs a chat model: the turns are chat messages, but the "
                          f"model {model} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")
    from transformers import AutoTokenizer

    from orchestrator.data import turns

    try:
        turns.observation_ids(AutoTokenizer.from_pretrained(str(model)), [{"role": "user", "content": "?"}])
    except Exception as e:  # noqa: BLE001 - a template or tokenizer that cannot render turns
        raise ConfigError(f"rl.environment={config.rl.environment}: the chat template of {model} cannot render a multi-turn "
                          f"conversation token-exactly: {e}") from None


def check_agent(config: RunConfig) -> None:
    """rl.agent imports here, and the model has a chat template (the endpoint renders the
    agent's messages with it)."""
    try:
        agents.load(config.rl.agent, config.rl.environment_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not has_chat_template(config.model_path):
        raise ConfigError(f"rl.agent={config.rl.agent} needs a chat model: its calls are chat messages, but the model "
                          f"{config.model_path} has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")


def check_resume(config: RunConfig) -> None:
    """A run stopped inside an iteration's rollout or eval (phases 1-6) resumes only with
    what that iteration was planned with: its rollout walked (``--rl-phase``; unless its train
    aggregate is there, salvaged by `recover`), the same tasks (``_TASK_KEYS``) and the same
    reward and environment (``_GRADING_KEYS``). Elsewhere anything may change."""
    layout = RunLayout(config.log_path)
    progress = fsio.read_record(layout.progress)
    if progress is None or progress["phase"] == Phase.SYNC_END:
        return
    iteration, phase = progress["iteration"], Phase(progress["phase"] + 1)
    where = (f"--log-path {config.log_path} is inside iteration {iteration}, before phase {phase.label} (stopped there, or "
             f"still walked by its master: `orchestrator status --log-path {config.log_path}` tells)")
    if phase > Phase.EVAL:
        return  # what is left of the iteration trains on its aggregate: the tasks are decided
    if not config.rl_phase.includes(phase):
        if shards.sealed(layout.iteration(iteration).aggregate("train")) is not None:
            return  # a salvaged aggregate (`recover --salvage`): the update trains on it
        raise ConfigError(f"{where}, which --rl-phase {config.rl_phase.value} does not walk, and the iteration has no train "
                          f"aggregate to train on: finish its rollout with an --rl-phase that includes it (or salvage what it "
                          f"has with `orchestrator recover --salvage {iteration}`), or start a new --log-path")
    start = fsio.read_record(layout.attempt(progress["attempt"]).start) or {}
    before, now = start.get("fingerprint"), config.fingerprint()
    if not before:
        return
    for key, path in (_TASK_KEYS | _GRADING_KEYS).items():
        old, new = before, now
        for part in path:
            known = part in (old or {})  # a key newer than the run's plan: nothing to compare with
            old, new = (old or {}).get(part), (new or {}).get(part)
        if known and old != new:
            change = "change that iteration's tasks" if key in _TASK_KEYS else "grade the rest of that iteration's samples otherwise"
            if key == "workload":  # a flag, not a key
                given, planned = ("--rehearsal", "the real loop") if new == WorkloadKind.REHEARSAL.value else ("the real loop", "--rehearsal")
                raise ConfigError(f"{where}; {given} would {change} (it was planned with {planned}): resume it "
                                  f"{'with' if planned == '--rehearsal' else 'without'} --rehearsal, or start a new --log-path")
            raise ConfigError(f"{where}; {key}={new!r} would {change} (it was planned with {key}={old!r}): "
                              f"resume with {key}={old!r} and change it after the iteration, or start a new --log-path")


def has_chat_template(model: Path) -> bool:
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def check_log_path(log_path: Path) -> None:
    """Raise ConfigError unless this node can create and write ``log_path``: it is a
    directory, or the nearest part of it that exists is a directory this process may write
    on a filesystem mounted read-write. Nothing is created (:func:`create_log_path` does)."""
    if log_path.exists():
        if not log_path.is_dir():
            raise ConfigError(f"--log-path {log_path} is a file, not a directory: give a directory (it is created when missing)")
        where = log_path
    else:
        where = next(p for p in log_path.parents if p.exists())
        if not where.is_dir():
            raise ConfigError(f"--log-path {log_path} cannot be created: {where} is a file, not a directory")
    why = _unwritable(where)
    if why:
        raise ConfigError(f"--log-path {log_path}: {where} {why}: give a directory this node can write, the same shared path on "
                          f"every node")


def create_log_path(log_path: Path) -> None:
    """Create ``log_path`` (the run's first write), as a ConfigError when the filesystem
    refuses it: a path check cannot foresee every refusal (``/proc``, a quota, a FUSE mount)."""
    try:
        log_path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--log-path {log_path} cannot be created here ({e.strerror}): give a directory this node can "
                          f"create and write, the same shared path on every node") from None


def _unwritable(directory: Path) -> str | None:
    """Why this process cannot create files in ``directory``, or None."""
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        return "is on a filesystem mounted read-only"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable by this user"
    return None


def os_error_line(e: OSError) -> str:
    """One line for an OSError on a user's path: ``PATH: Permission denied``."""
    what = e.strerror or type(e).__name__
    return f"{e.filename}: {what}" if e.filename else what
