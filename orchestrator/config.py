"""Typed run configuration: nested dataclasses, validated on construction.

Flags of ``orchestrator run`` fill the top level; every nested field is a
dotted key a user can override on the command line (``coordination.node_timeout_s=30``).
A field's bounds are msgspec constraints on its type (``Annotated[int, msgspec.Meta(ge=1)]``),
so the trainer, which decodes with the same types, and the run refuse the same values; one
walk over the fields checks them in every section, and the overrides take their keys and
types from the same fields. ``__post_init__`` adds only the rules between fields.
Validation raises :class:`ConfigError`, which the CLI turns into exit code 2 before
anything is written under ``--log-path``. Which rank this process is, and how many nodes
there are, the CLI works out (``orchestrator/cli/rank.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from orchestrator import defaults
from orchestrator.node import base_model
from orchestrator.errors import ConfigError
from orchestrator.phase_table import PHASE_TABLE, Phase, RLPhase
from orchestrator.train.settings import (  # noqa: F401 - the option names, for the modules that list them
    LORA_TARGET_MODULES,
    PRECISIONS,
    STRATEGIES,
    Count,
    NonNegativeInt,
    TrainerSettings,
    UpdateSettings,
    limit as _limit,
    one_of as _one_of,
)


class RolloutSplit(enum.Enum):
    TRAIN_ONLY = "train-only"
    EVAL_ONLY = "eval-only"


class WorkloadKind(enum.Enum):
    REHEARSAL = "rehearsal"
    RL = "rl"


# --- field constraints ------------------------------------------------------------------
# A constrained field's error is ``"{key} must be > 0, got {value}"`` with its bounds; a field
# worded otherwise carries its own template in the Meta's ``extra["error"]``, formatted with
# ``key`` (``rl.lr``, or the flag ``--num-nodes`` at the top level), ``value`` and ``self``.


def _bounds(meta: msgspec.Meta) -> str:
    """``"> 0"``, or ``"in (0, 1]"`` when both ends are bounded: how a default error words them."""
    low = f"({meta.gt}" if meta.gt is not None else f"[{meta.ge}" if meta.ge is not None else ""
    high = f"{meta.lt})" if meta.lt is not None else f"{meta.le}]" if meta.le is not None else ""
    if low and high:
        return f"in {low}, {high}"
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return " and ".join(f"{op} {getattr(meta, k)}" for k, op in ops.items() if getattr(meta, k) is not None)


def _meta(hint) -> msgspec.Meta | None:
    """The Meta of ``Annotated[int, msgspec.Meta(ge=1)]``, also inside ``... | None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(filter(None, map(_meta, typing.get_args(hint))), None)
    return next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)


@functools.cache
def _constrained_fields(cls: type) -> tuple[tuple[str, object, msgspec.Meta], ...]:
    """``(name, type, meta)`` for each field of dataclass ``cls`` whose type carries a Meta."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple((f.name, hints[f.name], meta) for f in dataclasses.fields(cls) if (meta := _meta(hints[f.name])))


def _check_fields(obj, section: str | None) -> None:
    """Raise ConfigError for the first field of ``obj`` that msgspec finds outside its type's
    constraints. ``section`` is the key's prefix; None: the top level, whose keys are flags."""
    for name, hint, meta in _constrained_fields(type(obj)):
        value = getattr(obj, name)
        try:
            msgspec.convert(value, hint)
        except msgspec.ValidationError:
            key = f"{section}.{name}" if section else f"--{name.replace('_', '-')}"
            error = (meta.extra or {}).get("error", "{key} must be " + _bounds(meta) + ", got {value}")
            raise ConfigError(error.format(key=key, value=value, self=obj)) from None


Seconds = Annotated[float, _limit("{key} must be a positive number of seconds, got {value}", gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]


@dataclass(kw_only=True, slots=True)
class CoordinationConfig:
    heartbeat_interval_s: Seconds = 5.0
    """How often each rank rewrites its heartbeat counter. At most node_timeout_s / 4."""
    node_timeout_s: Seconds = defaults.NODE_TIMEOUT_S
    """A rank whose heartbeat counter has not changed for this long (on the reader's own
    monotonic clock) is dead. Must exceed the filesystem's cache window (NFS attributes up to
    60 s, blobfuse2 120 s by default), GC pauses and server stalls."""
    join_timeout_s: Seconds = 900.0
    """How long ranks wait for every rank to join an attempt before failing, naming the absent."""
    master_wait_s: Annotated[float, _limit("{key} must be >= 0 seconds, got {value}", ge=0)] | None = None
    """After the master dies, how long the workers wait for a new one (restart only rank 0
    with the same command) before they exit; 0: they exit at once (exit 3) and every node
    is re-run. Unset: join_timeout_s with elastic (a run that goes on without a node also
    waits for its master), else 0."""
    poll_min_s: Seconds = 0.002
    """First poll interval of a wait; it doubles up to poll_max_s."""
    poll_max_s: Seconds = 0.1
    """Longest interval between two polls of a known file name while a rank joins, claims
    work or waits for a short step (barrier waits and watching peers go by watch_interval_s)."""
    watch_interval_s: Seconds = 1.0
    """How often a worker reads the master's heartbeat (alive? aborted? released?) while it
    works, and the longest interval between two reads while it waits at a barrier (the first
    come 2 ms, 4 ms, ... after it arrives). With the heartbeat's own write, a worker costs the
    shared filesystem about 1/watch_interval_s + 2/heartbeat_interval_s metadata operations a
    second (1.4 by default). Ranks on the master's host are woken at once by inotify; lower
    it to trade load for barrier latency across hosts. At most a quarter of node_timeout_s
    is used."""
    fan_in: Annotated[int, _limit("{key} must be >= 0 (0: automatic, 1: off), got {value}", ge=0)] = 0
    """Barriers that fan in: the workers form groups of this many consecutive ranks, whose
    leader (the lowest rank of a group still in the run) reads its members' arrivals and
    passes them on in one file, so the master reads about sqrt(N) files a barrier instead
    of N. 0: automatic (groups of ceil(sqrt(workers)) from 64 ranks on, off below); 1: off;
    2 or more: groups of that size."""
    work_stealing: bool = True
    """Rollout and eval tasks go out in chunks; a rank that has finished its own takes chunks
    not yet started from the rank with the most left, so a phase ends when its work ends.
    --rank-weights sets the first split. Off: each rank does exactly its weighted share."""
    chunk_tasks: Annotated[int, _limit("{key} must be >= 0 (0: automatic), got {value}", ge=0)] = 0
    """Tasks per chunk with work stealing; 0: about 32 chunks per rank (never smaller than
    what one engine request carries)."""
    elastic: bool = False
    """A worker that dies or freezes is marked out within node_timeout_s and the run goes on
    without it (its unsealed rollout and eval work done by the others; lost mid-training, the
    others train that step again without it); the same command on that node rejoins at the
    next iteration's start, and workers wait for a restarted master (master_wait_s). Off: a dead worker ends the attempt on
    every rank (exit 3). Off by default: training then runs on fewer workers, whose shards of
    the model and optimizer are larger than the ones the run was sized for."""
    min_nodes: Count = 1
    """With elastic: the fewest ranks the run goes on with; losing one more ends the attempt."""

    @property
    def watch_s(self) -> float:
        """How often a worker reads the master's heartbeat: watch_interval_s, or a quarter of
        node_timeout_s when that is shorter (a few reads within any node timeout, each of which
        may find the file unreadable for a moment)."""
        return min(self.watch_interval_s, self.node_timeout_s / 4)

    @property
    def master_wait(self) -> float:
        """Seconds workers wait for a restarted master (master_wait_s, or its default)."""
        if self.master_wait_s is not None:
            return self.master_wait_s
        return self.join_timeout_s if self.elastic else 0.0

    def __post_init__(self) -> None:
        _check_fields(self, "coordination")
        if self.heartbeat_interval_s * 4 > self.node_timeout_s:
            raise ConfigError(
                f"coordination.heartbeat_interval_s ({self.heartbeat_interval_s}) must be at most a quarter of "
                f"coordination.node_timeout_s ({self.node_timeout_s}), or a live rank can look dead"
            )
        if self.poll_min_s > self.watch_interval_s:
            raise ConfigError(f"coordination.poll_min_s ({self.poll_min_s}) must not exceed watch_interval_s ({self.watch_interval_s})")
        if self.poll_min_s > self.poll_max_s:
            raise ConfigError(f"coordination.poll_min_s ({self.poll_min_s}) must not exceed poll_max_s ({self.poll_max_s})")


def _deadline_fields() -> list[tuple[str, object, dataclasses.Field]]:
    return [(p.name.lower(), Seconds, field(default=PHASE_TABLE[p].deadline_s,
                                            metadata={"help": f"Seconds phase {p.label} may take: its work and its barrier."}))
            for p in Phase]


DeadlineConfig = dataclasses.make_dataclass(
    "DeadlineConfig",
    _deadline_fields(),
    namespace={
        "__post_init__": lambda self: _check_fields(self, "deadlines"),
        "__doc__": "Seconds each phase (its work and its barrier) may take, one key per phase.",
        "for_phase": lambda self, phase: getattr(self, phase.name.lower()),
    },
    kw_only=True,
    slots=True,
)


_RehearsalTasks = Annotated[int, _limit(
    "rehearsal.tasks and rehearsal.eval_tasks must be at least 1, got {self.tasks}, {self.eval_tasks}", ge=1)]


@dataclass(kw_only=True, slots=True)
class RehearsalConfig:
    tasks: _RehearsalTasks = 24
    """Rollout tasks per iteration, split over the ranks by weight."""
    eval_tasks: _RehearsalTasks = 8
    """Eval tasks per evaluated iteration."""
    work_s: NonNegative = 0.2
    """Simulated seconds of work in each working phase (rollout, eval, train)."""
    record_bytes: NonNegativeInt = 256
    """Payload bytes per simulated trajectory record."""
    task_s: NonNegative = 0.0
    """Simulated seconds per rollout or eval task; 0: a rank's first share takes work_s."""
    train_s: NonNegative = 0.0
    """Simulated seconds of training per iteration on a node with train workers; 0: work_s."""
    slow_ranks: str = ""
    """``"R:F,..."``: rank R takes F times longer per task (a slow node, to rehearse work stealing)."""

    def __post_init__(self) -> None:
        _check_fields(self, "rehearsal")
        self.slowdown  # validates rehearsal.slow_ranks

    @property
    def slowdown(self) -> dict[int, float]:
        """``slow_ranks`` as {rank: factor}."""
        factors: dict[int, float] = {}
        for item in filter(None, (part.strip() for part in self.slow_ranks.split(","))):
            rank, sep, factor = item.partition(":")
            try:
                r, f = int(rank), float(factor)
            except ValueError:
                r, f = -1, 0.0
            if not sep or r < 0 or not 0 < f < math.inf:
                raise ConfigError(f"rehearsal.slow_ranks must be \"RANK:FACTOR,...\" with a rank >= 0 and a factor > 0, "
                                  f"e.g. \"2:4\" (rank 2 takes 4 times longer per task); got {self.slow_ranks!r}")
            factors[r] = f
        return factors


# The update's keys, types, bounds and option names are the trainer's (train/settings.py): the
# rl and train sections derive from its UpdateSettings and TrainerSettings.
MaxPromptTokens = Annotated[int, msgspec.Meta(ge=0)]
STEP_REWARDS = ("sum", "last")

_Temperature = Annotated[float, _limit("rl.temperature and rl.eval_temperature must be >= 0", ge=0)]
_StopStrings = Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], _limit("{key} must be non-empty strings, got {value!r}")]


@dataclass(kw_only=True, slots=True)
class RLConfig(UpdateSettings):
    train_tasks: Count = 384
    """Train tasks (prompts) per iteration, sampled from tasks/train.jsonl, split by weight."""
    samples_per_prompt: Count = 8
    """Completions drawn per prompt: one GRPO group."""
    temperature: _Temperature = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    max_prompt_tokens: MaxPromptTokens = 0
    """Tasks whose prompt (as the engine sees it: rendered, special tokens included) is longer
    than this many tokens are left out of the run, with a count in the log and in every
    iteration's summary. 0: the model's context length minus rl.max_tokens."""
    stop: _StopStrings = field(default_factory=list)
    """Strings that end a completion (cut from its text), besides every EOS id of the model's
    generation_config. On the command line a JSON list, rl.stop='["</answer>", "\\n\\n"]', or one string."""
    eval_tasks: Count = 200
    """Eval tasks, the first of tasks/test.jsonl: the same set every evaluated iteration."""
    eval_samples: Count = 4
    """Completions per eval task: accuracy is their mean reward, pass@k their best."""
    eval_temperature: _Temperature = 0.5
    reward: str = "orchestrator.rewards:exact_match"
    """The reward function, as module:function (task dict, completion text) -> float;
    orchestrator.rewards:judge asks a judge model (the judge section)."""
    eval_reward: str = ""
    """Eval's reward, as rl.reward (empty: rl.reward's): e.g. a verifiable reward measuring a
    run that trains on a judge's."""
    max_reward_error_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.01
    """A sample whose reward (or environment) raises scores 0; a rank fails when more than this
    share of the samples of its rollout failed."""
    environment: str = ""
    """Multi-turn rollouts: the environment class, as module:Class (a new instance per sample;
    docs/environments.md). Empty: one turn, scored by rl.reward."""
    environment_args: dict[str, typing.Any] = field(default_factory=dict)
    """With rl.environment: keyword arguments of every instance, a JSON object on the command
    line (rl.environment_args='{"difficulty": 3}'); a task's own environment_args column
    updates them for its samples. With rl.agent=verifiers:<id>: the taskset's config."""
    agent: str = ""
    """Agents through an OpenAI-compatible endpoint: the agent function, as module:function,
    called once per sample as function(task, base_url) (docs/environments.md); verifiers:<id>:
    a verifiers environment's episodes. Empty: none."""
    teacher: str = ""
    """On-policy distillation: the name of the model (models.<name>.path) whose log-probs of
    every sampled token the rollout records (teacher_logprobs); the update takes the per-token
    reverse KL to it into the advantage, weighted by rl.distill_coef. Empty: none."""
    max_turns: Count = 4
    """With rl.environment: the most turns of the model in a sample (given to the environment
    as max_turns when it takes an argument of that name)."""
    step_rewards: Annotated[str, _one_of(STEP_REWARDS, "rl.step_rewards values")] = "sum"
    """With rl.environment: a sample's reward is its steps' rewards summed (sum), or its last
    step's (last)."""
    env_timeout_s: Seconds = 60.0
    """With rl.environment: an environment call (the class, reset, step) that takes longer ends
    its sample with reward 0 and the error recorded, as a failing reward does."""
    max_resample_rounds: NonNegativeInt = 2
    """With rl.filter_groups: how many further rounds of prompts an iteration's rollout may draw."""
    max_staleness: NonNegativeInt = 0
    """How many checkpoints a trajectory may lag behind the update that trains on it. 0:
    lockstep, each iteration's rollout then its update. K >= 1: the rollout of iteration i
    runs while iterations i-K.. train, once checkpoint i-1-K is published (rollout and
    training on different nodes: train.nodes/rollout.nodes, or disaggregated device mappings).
    docs/rl.md, "Asynchronous RL"."""
    train_on_partial: bool = False
    """Train on an aggregate that `orchestrator recover --salvage` marked partial (some
    planned tasks missing). Off: such an iteration is refused in phase 8."""
    train_port: int = 29500
    """First TCP port the master tries for the training rendezvous."""
    train_timeout_s: float = 600.0
    """Collective timeout of the training process group: a lost peer fails the step."""

    def __post_init__(self) -> None:
        _check_fields(self, "rl")
        try:
            self.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        from orchestrator.plugins import rewards

        from orchestrator.plugins import environments

        try:
            rewards.parse(self.reward)  # importing it is the preflight's (it depends on the node)
            if self.eval_reward:
                rewards.parse(self.eval_reward, "rl.eval_reward")
            if self.environment:
                environments.parse(self.environment)
            if self.agent:
                from orchestrator.plugins import agents

                agents.parse(self.agent)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.environment.startswith("verifiers:"):
            raise ConfigError(f"rl.environment={self.environment}: a verifiers environment drives the model itself, through the "
                              f"agent endpoint: set rl.agent={self.environment} instead (docs/environments.md)")
        if self.agent and self.environment:
            raise ConfigError(f"rl.agent={self.agent} and rl.environment={self.environment} both say how a sample runs: set one")

    @property
    def correction(self) -> str:
        """rl.is_correction with auto resolved: tis when rl.max_staleness >= 1 (unless the
        engine's log-probs are the old policy's already), else none."""
        if self.is_correction != "auto":
            return self.is_correction
        return "tis" if self.max_staleness and self.old_logprobs == "trainer" else "none"


ENGINES = ("embedded", "vllm")
TOOL_PARSERS = ("hermes", "llama3_json")  # orchestrator/agents/tool_parsers.py
WEIGHT_UPDATES = ("auto", "restart")

NonEmpty = Annotated[str, _limit("{key} must not be empty", min_length=1)]


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the tasks come from (docs/data.md)."""

    train_file: NonEmpty = "tasks/train.jsonl"
    """Train tasks, JSON lines or Parquet (.parquet); relative paths are under --data-path.
    reasoning_gym:<name>[+<name>...]: tasks reasoning-gym generates; verifiers:<id>: a verifiers
    taskset's tasks (docs/environments.md)."""
    test_file: NonEmpty = "tasks/test.jsonl"
    """Eval tasks, in the same formats."""
    train_size: Count = 1000
    """With data.train_file=reasoning_gym:... (or verifiers:<id>): the train tasks generated, shared by the datasets."""
    test_size: Count = 200
    """With data.test_file=reasoning_gym:... (or verifiers:<id>): the eval tasks generated (none a train task)."""
    prompt_key: NonEmpty = "prompt"
    """The column of the prompt: a string, or a list of chat messages rendered with the model's chat template."""
    answer_key: NonEmpty = "answer"
    """The column of the reference answer the reward compares with."""
    id_key: NonEmpty = "id"
    """The column of a task's unique id; a file without it numbers its rows (1, 2, ...)."""
    system_prompt: str = ""
    """A system message put before every prompt (a string prompt then becomes the user's
    message); both go through the chat template."""

    def __post_init__(self) -> None:
        _check_fields(self, "data")
        for name in ("train_file", "test_file"):
            if getattr(self, name).startswith(("reasoning_gym:", "verifiers:")):
                continue  # generated: checked where it is imported (data/reasoning_gym_tasks.py, data/verifiers_tasks.py)
            if Path(getattr(self, name)).suffix not in (".jsonl", ".json", ".parquet"):
                raise ConfigError(f"data.{name}={getattr(self, name)!r}: task files are JSON lines (.jsonl) or Parquet (.parquet)")


VLLM_MAX_LORA_RANK = 512


@dataclass(kw_only=True, slots=True)
class TrainPlacementConfig(TrainerSettings):
    device_mapping: str = ""
    """Global GPU ranks of the train workers, one GPU each: "0-15", "0,1,2,3" (empty: CPU, one
    worker per node). See docs/placement.md."""
    nodes: str = ""
    """Without device mappings (CPU): the node ranks that run a train worker, "0" or "0,2" or
    "0-3" (empty: every node). With rollout.nodes, a CPU run can keep training and rollout
    on separate nodes. See docs/placement.md."""
    keep_alive: bool = True
    """One trainer process per train worker for the whole attempt: it forms the process group
    once and keeps the model and the optimizer in memory across iterations. false: a new
    trainer process per iteration, which loads the checkpoint (weights and optimizer state)."""


    def __post_init__(self) -> None:
        _check_fields(self, "train")
        try:
            self.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None


_EngineGPUs = Annotated[int, _limit("rollout.gpus_per_engine and rollout.pipeline_parallel_size must be at least 1", ge=1)]
_Timeout = Annotated[float, _limit("{key} must be a positive number of seconds", gt=0)]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: Annotated[str, _one_of(ENGINES, "engines")] = "embedded"
    """Inference engine: "embedded" (this package's server, CPU) or "vllm"."""
    device_mapping: str = ""
    """Global GPU ranks of the inference engines (empty: CPU, one engine per node)."""
    nodes: str = ""
    """Without device mappings (CPU): the node ranks that run an engine and roll out, as
    train.nodes (empty: every node). A node with engines and no train worker is a rollout
    node."""
    gpus_per_engine: _EngineGPUs = 1
    """GPUs per engine: tensor_parallel_size x pipeline_parallel_size."""
    pipeline_parallel_size: _EngineGPUs = 1
    """vLLM pipeline stages per engine; tensor parallel size is gpus_per_engine / this."""
    engine_port: Annotated[int, _limit("{key} must be a TCP port (0-65535), got {value}", ge=0, le=65535)] = 8000
    """Port of a node's first engine; its next engines take the next ports (the first free one
    from there at start)."""
    engine_url: str = "http://127.0.0.1:8000"
    """With --debug-mode: the engine already running, used as it is."""
    engine_start_timeout_s: _Timeout = 300.0
    max_inflight: Annotated[int, _limit("{key} must be >= 0 (0: the engine's default), got {value}", ge=0)] = 0
    """Sequences (prompts x samples) a rank keeps in flight on each engine, in requests of
    rollout.prompts_per_request prompts, so that the engine's continuous batching always has
    work and no completion waits for another request's longest one. 0: the engine's default
    (1024). With rl.agent, also how many agents run at once, per engine."""
    tool_parser: Annotated[str, _one_of(TOOL_PARSERS, "tool parsers")] = "hermes"
    """With rl.agent: how the model's tool calls are read out of its text for the agent endpoint's
    structured tool_calls: hermes (<tool_call>{...}</tool_call>, Qwen's and Hermes' templates)
    or llama3_json (a JSON object, Llama 3.1-3.3)."""
    partial: bool = False
    """Partial rollouts: a train rollout rolls out rollout.oversample more tasks than it trains,
    each rank stops its engines once its share of rl.train_tasks groups is complete, and the
    unfinished samples are kept (their tokens, log-probs and policies) and continued first by the
    next iteration's rollout; eval never is. Not with rl.filter_groups."""
    oversample: Annotated[float, _limit("{key} must be in (0, 1], got {value}", gt=0, le=1)] = 0.25
    """With rollout.partial: the share of rl.train_tasks a train rollout rolls out beyond them
    (0.25: 480 tasks for 384 trained); at most that many groups are carried to the next."""
    max_carry: Annotated[int, _limit("{key} must be >= 1, got {value}", ge=1)] = 1
    """With rollout.partial: how many times a group may be carried into a later rollout; one
    carried that many times is not stopped again, so that no token is trained more than
    rl.max_staleness + rollout.max_carry checkpoints after its policy."""
    prompts_per_request: Annotated[int, _limit("{key} must be >= 0 (0: the engine's default), got {value}", ge=0)] = 0
    """Prompts in one request to an engine, each with its samples. 0: the engine's default:
    one for vLLM (a request carries one seed, which every prompt in it would share); for the
    embedded engine as many as make 128 sequences (16 at 8 samples a prompt), since each
    request costs an HTTP round trip and a prefill of its own."""
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9
    """vLLM: fraction of each GPU's memory the engine may take."""
    max_model_len: NonNegativeInt = 0
    """vLLM: longest sequence (0: the model's own)."""
    dtype: str = "auto"
    """vLLM: weight dtype (float32 on CPU)."""
    engine_args: str = ""
    """vLLM: more serve arguments, as one shell-quoted string (e.g. "--enforce-eager")."""
    weight_update: Annotated[str, _one_of(WEIGHT_UPDATES, "values")] = "auto"
    """How a running engine moves to a new checkpoint: "auto" reloads the weights in place
    (vLLM's reload_weights) and restarts when that fails; "restart" always restarts."""
    local_cache: str = ""
    """With publish.delta: the node-local directory where each node rebuilds the version its
    engines serve (from the one they hold plus the delta) before moving them to it; local
    disk or tmpfs, cleaned as versions retire (empty: a directory in the node's temp dir)."""
    memory_release_timeout_s: _Timeout = 120.0
    """Colocated GPUs: how long training waits for the engines' GPU memory to be released."""
    memory_released_mib: int = 2048
    """Colocated GPUs: memory in use per GPU below which it counts as released."""

    def __post_init__(self) -> None:
        _check_fields(self, "rollout")
        if self.gpus_per_engine % self.pipeline_parallel_size:
            raise ConfigError(
                f"rollout.pipeline_parallel_size={self.pipeline_parallel_size} does not divide rollout.gpus_per_engine="
                f"{self.gpus_per_engine} (tensor parallel size = gpus_per_engine / pipeline_parallel_size)"
            )

    @property
    def tensor_parallel_size(self) -> int:
        return self.gpus_per_engine // self.pipeline_parallel_size


JUDGE_PARSES = ("verdict", "score")  # orchestrator/plugins/judge.py


@dataclass(kw_only=True, slots=True)
class JudgeConfig:
    """The LLM judge of rl.reward=orchestrator.rewards:judge (docs/rl.md, "An LLM judge as the
    reward"): a model beside the policy asked about each completion."""

    model: str = ""
    """The judge: the name of a model beside the policy (models.<name>.path)."""
    template: str = ""
    """The judge's prompt: a text file (a relative path is under --data-path) with the fields
    {question}, {completion}, {answer} and {task[column]}; empty: the built-in reference-guided
    verdict (docs/rl.md)."""
    parse: Annotated[str, _one_of(JUDGE_PARSES, "judge.parse values")] = "verdict"
    """How the judge's reply becomes the reward: verdict (its last yes/no, correct/incorrect:
    1 or 0) or score (its last number divided by judge.max_score)."""
    max_score: Annotated[float, _limit("{key} must be > 0, got {value}", gt=0)] = 10.0
    """With judge.parse=score: the score that is a reward of 1."""
    max_tokens: Annotated[int, _limit("{key} must be >= 1, got {value}", ge=1)] = 256
    """The longest reply the judge may write (and no longer than its context leaves after the question)."""
    temperature: Annotated[float, _limit("{key} must be >= 0, got {value}", ge=0)] = 0.0
    """The judge's sampling temperature (0: greedy)."""

    def __post_init__(self) -> None:
        _check_fields(self, "judge")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Which iteration checkpoints the master keeps (checkpoints/retention.py). Whatever these say,
    the current checkpoint and every checkpoint a consumer marker names are kept too."""

    keep_last: Annotated[int, _limit("{key} must be at least 1 (the current checkpoint is always kept), got {value}", ge=1)] = 3
    """The newest checkpoints kept, the current one among them; at least 1."""
    keep_every: Annotated[int, _limit("{key} must be >= 0 (0: none kept for that reason), got {value}", ge=0)] = 0
    """Also keep the checkpoint of every iteration divisible by this (0: none kept for that reason)."""
    state_every: Annotated[int, _limit("{key} must be at least 1 (1: every checkpoint holds it), got {value}", ge=1)] = 10
    """Write the training state (fp32 master weights, optimizer state) into the checkpoints of
    iterations divisible by this, of the last iteration and of one a stop was asked in; the
    others hold only the published weights. A trainer that must start from a checkpoint
    without it trains the iterations since the last state again from their aggregates
    (docs/training.md, "The training state: written when it pays, replayed exactly")."""

    def __post_init__(self) -> None:
        _check_fields(self, "checkpoint")


PUBLISH_DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(kw_only=True, slots=True)
class PublishConfig:
    """How each checkpoint's weights reach the engines (docs/training.md, "Dtypes: what is
    kept in which")."""

    dtype: Annotated[str, _one_of(PUBLISH_DTYPES, "dtypes")] = "auto"
    """The dtype of the weights the engines read: auto (the dtype they serve: rollout.dtype
    with vLLM when it names one, else the base model's), bf16, fp16 or fp32. Other than fp32,
    the checkpoint keeps the fp32 master weights apart (master/), for the trainer alone."""
    delta: bool = True
    """Publish each version's weights as the XOR of their bits against the version before,
    compressed with zstd, where that is smaller than the weights (a few percent at RL's
    learning rates); each node rebuilds the version in rollout.local_cache."""
    full_every: Annotated[int, _limit("{key} must be at least 1 (1: every version whole), got {value}", ge=1)] = 10
    """With publish.delta: iterations divisible by it publish their weights whole, which
    bounds the chain a node rebuilds from after a restart."""

    def __post_init__(self) -> None:
        _check_fields(self, "publish")


TRACKING_BACKENDS = ("tensorboard", "wandb", "mlflow")


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    """Experiment tracking: the master logs every iteration's figures to these backends as
    well as to the run's own files (docs/operations.md, "Experiment tracking")."""

    backends: list[str] = field(default_factory=list)
    """Any of tensorboard, wandb, mlflow: tracking.backends=tensorboard,wandb (empty: none).
    They need the optional packages: pip install 'orchestrator[tracking]'."""
    project: str = "orchestrator"
    """The wandb project, the mlflow experiment."""
    run_name: str = ""
    """The tracked run's name (empty: the last part of --log-path)."""

    def __post_init__(self) -> None:
        names = [n.strip() for item in self.backends for n in item.split(",") if n.strip()]
        unknown = [n for n in names if n not in TRACKING_BACKENDS]
        if unknown:
            raise ConfigError(f"tracking.backends names {', '.join(map(repr, unknown))}: the backends are "
                              f"{', '.join(TRACKING_BACKENDS)}, e.g. tracking.backends=tensorboard,wandb")
        self.backends = list(dict.fromkeys(names))


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The base model the run starts from (docs/data.md, "Where the model comes from")."""

    path: str = ""
    """A Hugging Face model directory (a relative path is under --data-path), or a hub id such as
    Qwen/Qwen2.5-0.5B-Instruct found in the local Hugging Face cache (never downloaded); empty:
    <data-path>/model."""


MODEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
"""What a models.<name> may be called."""


@dataclass(kw_only=True, slots=True)
class AuxModelConfig:
    """A model the run serves beside the policy, ``models.<name>``: a teacher (rl.teacher) or a
    judge (judge.model)."""

    path: str = ""
    """Its Hugging Face directory (a relative path is under --data-path) or a hub id found in
    the local Hugging Face cache, as model.path. Served by an engine of its own (rollout.engine's
    kind) on each node that serves it, started with the policy's, never reloaded."""
    nodes: str = ""
    """On CPU, the nodes that serve it, e.g. "2" or "0-1" (empty: every node that rolls out,
    each its own engine). The nodes that roll out and do not serve it send its requests to
    the engines of those that do, found on the shared filesystem; a node that dies is left
    out of them."""
    device_mapping: str = ""
    """On GPUs (a run with device mappings, where it is required), the GPUs of its engines, as
    global GPU ranks like rollout.device_mapping: one engine on each node over that node's GPUs
    of it. Never shared with train.device_mapping or rollout.device_mapping."""


@dataclass(kw_only=True, slots=True)
class RunConfig:
    data_path: Path
    log_path: Path
    rl_phase: RLPhase
    rank: int
    num_nodes: Count = 1
    rank_weights: tuple[float, ...] | None = (1.0,)
    """Each node's share of rollout and eval; None: ``--rank-weights auto`` (by the GPUs of
    each node's engines, known once the nodes report theirs)."""
    eval_interval: Count | None = None
    rollout_split: RolloutSplit | None = None
    max_iterations: Count | None = None
    workload: WorkloadKind = WorkloadKind.RL
    debug_mode: bool = False
    seed: int = 0
    """Seeds task sampling and everything random in the run."""
    coordination: CoordinationConfig = field(default_factory=CoordinationConfig)
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)  # type: ignore[valid-type]
    rehearsal: RehearsalConfig = field(default_factory=RehearsalConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainPlacementConfig = field(default_factory=TrainPlacementConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    models: dict[str, AuxModelConfig] = field(default_factory=dict)
    """The models served beside the policy, by name (``models.<name>.path=...``)."""
    keys_from_data: tuple[str, ...] = ()
    """The ``key=value`` settings taken from --data-path's demo.json because the command line
    did not set them (data/run_keys.py); their values are in the sections like any other."""

    def __post_init__(self) -> None:
        for name in ("data_path", "log_path"):
            if not Path(getattr(self, name)).is_absolute():
                raise ConfigError(f"--{name.replace('_', '-')} must be an absolute path (the same on every node), got {getattr(self, name)!s}")
        _check_fields(self, None)
        if self.rank_weights is not None:
            if len(self.rank_weights) != self.num_nodes:
                raise ConfigError(
                    f"--rank-weights has {len(self.rank_weights)} value(s) but --num-nodes is {self.num_nodes}: "
                    f"give exactly one weight per node, e.g. \"{','.join(['1'] * self.num_nodes)}\", or auto"
                )
            if any(not (0 <= w < math.inf) for w in self.rank_weights) or not any(w > 0 for w in self.rank_weights):
                raise ConfigError(f"--rank-weights must be numbers >= 0 (0 only for a node without rollout engines), at least one "
                                  f"positive, got {','.join(map(_fmt, self.rank_weights))}")
        if self.coordination.min_nodes > self.num_nodes:
            raise ConfigError(f"coordination.min_nodes={self.coordination.min_nodes} exceeds --num-nodes {self.num_nodes}")
        if not 0 <= self.rank < self.num_nodes:
            raise ConfigError(f"rank {self.rank} is out of range: with --num-nodes {self.num_nodes} valid ranks are 0..{self.num_nodes - 1}")
        if self.rl_phase is RLPhase.BOTH and self.eval_interval is None:
            raise ConfigError("--rl-phase both needs --eval-interval N (evaluate on iterations 1, 1+N, 1+2N, ...)")
        if self.rl_phase is RLPhase.ROLLOUT and self.rollout_split is None:
            raise ConfigError("--rl-phase rollout needs --rollout-split train-only|eval-only")
        if any(r >= self.num_nodes for r in self.rehearsal.slowdown):
            raise ConfigError(f"rehearsal.slow_ranks={self.rehearsal.slow_ranks!r} names a rank outside 0..{self.num_nodes - 1}")
        from orchestrator.node import placement

        train, rollout = placement.check_mappings(self.train.device_mapping, self.rollout.device_mapping, self.rollout.gpus_per_engine)
        self._check_models()
        serving = placement.check_aux(self.models, train, rollout, self.num_nodes)
        train_nodes, rollout_nodes = placement.check_role_nodes(self.train.nodes, self.rollout.nodes, self.num_nodes,
                                                                gpu=bool(self.train.device_mapping), serving=serving)
        if not self.train.device_mapping and self.rank_weights is not None:
            placement.check_cpu_weights(self.rank_weights, rollout_nodes)
        self._check_overlap(train_nodes, rollout_nodes)
        self._check_partial()
        if self.workload is WorkloadKind.RL and self.rollout.engine == "vllm" and self.train.lora_rank > VLLM_MAX_LORA_RANK:
            raise ConfigError(f"train.lora_rank={self.train.lora_rank}: vLLM serves LoRA adapters up to rank {VLLM_MAX_LORA_RANK}")
        if self.workload is WorkloadKind.RL and self.rollout.engine == "vllm" and not self.debug_mode:
            for temp, n, what in ((self.rl.temperature, self.rl.samples_per_prompt, "rl.temperature/rl.samples_per_prompt"),
                                  (self.rl.eval_temperature, self.rl.eval_samples, "rl.eval_temperature/rl.eval_samples")):
                if temp == 0 and n > 1:
                    raise ConfigError(f"{what} = 0/{n}: vLLM refuses more than one sample per prompt at temperature 0 "
                                      f"(greedy sampling gives one answer); raise the temperature or use 1 sample")

    def _check_partial(self) -> None:
        """rollout.partial continues samples from their tokens (an environment's or an agent's by
        replaying its turns): refused where a round is drawn by its groups."""
        if self.rollout.partial and self.workload is WorkloadKind.RL and self.rl.filter_groups:
            raise ConfigError(f"rollout.partial=true does not continue samples of rl.filter_groups, and "
                              f"rl.filter_groups={self.rl.filter_groups} is set: unset one of them")

    def _check_models(self) -> None:
        """Every models.<name> has a path; rl.teacher names one of them, and the update weighs it."""
        for name, model in self.models.items():
            if not MODEL_NAME.fullmatch(name) or name == "policy":
                raise ConfigError(f"models.{name}: a model's name is a letter then letters, digits, - or _ (and not policy)")
            if not model.path:
                raise ConfigError(f"models.{name} has no path: set models.{name}.path=<a Hugging Face model directory>")
        if self.models and self.debug_mode:
            raise ConfigError(f"models.{next(iter(self.models))}: --debug-mode serves only the policy, at rollout.engine_url; "
                              f"run without --debug-mode to serve models beside it")
        self._check_judge()
        teacher, coef = self.rl.teacher, self.rl.distill_coef
        if teacher and teacher not in self.models:
            raise self._no_model("rl.teacher", teacher)
        if teacher and not coef:
            raise ConfigError(f"rl.teacher={teacher} needs rl.distill_coef > 0 (the weight of the per-token reverse KL to "
                              f"it in the advantage), e.g. rl.distill_coef=1")
        if coef and not teacher:
            raise ConfigError(f"rl.distill_coef={coef:g} needs a teacher: set rl.teacher=<name> and models.<name>.path")

    def _no_model(self, key: str, name: str) -> ConfigError:
        """The error of ``key=name`` naming no models.<name>."""
        named = f"the models are {', '.join(self.models)}" if self.models else "no models.<name>.path is set"
        return ConfigError(f"{key}={name} names no model: {named}; set models.{name}.path=<its directory>")

    def _check_judge(self) -> None:
        """The judge reward has a judge among the models, and a judge is there for it."""
        from orchestrator.plugins import rewards

        judged = [f"{key}={spec}" for key, spec in (("rl.reward", self.rl.reward), ("rl.eval_reward", self.rl.eval_reward))
                  if rewards.is_judge(spec)]
        model = self.judge.model
        if model and not judged:
            raise ConfigError(f"judge.model={model} is set but no reward asks it: set rl.reward=orchestrator.rewards:judge "
                              f"(or rl.eval_reward), or unset judge.model")
        if not judged:
            return
        if not model:
            raise ConfigError(f"{judged[0]} asks a judge model: set judge.model=<name> and models.<name>.path=<its directory>")
        if model not in self.models:
            raise self._no_model("judge.model", model)
        if self.rl.environment or self.rl.agent:
            how = f"rl.environment={self.rl.environment}" if self.rl.environment else f"rl.agent={self.rl.agent}"
            raise ConfigError(f"{judged[0]} judges single-turn completions, and {how} is set: an environment or an agent "
                              f"scores its own samples")

    def _check_overlap(self, train_nodes: tuple[int, ...], rollout_nodes: tuple[int, ...]) -> None:
        """rl.max_staleness >= 1 overlaps rollout with training: on nodes apart, walking both halves."""
        k = self.rl.max_staleness
        if not k:
            return
        if self.rl_phase is not RLPhase.BOTH:
            raise ConfigError(f"rl.max_staleness={k} overlaps the rollout half with the update half: it needs --rl-phase both")
        if not self.train.device_mapping and set(train_nodes) & set(rollout_nodes):
            both = sorted(set(train_nodes) & set(rollout_nodes))
            raise ConfigError(f"rl.max_staleness={k} runs rollout while training, so they need nodes of their own, but node(s) "
                              f"{','.join(map(str, both))} would do both: set train.nodes and rollout.nodes apart "
                              f"(e.g. train.nodes=0 rollout.nodes={'1' if self.num_nodes <= 2 else f'1-{self.num_nodes - 1}'}, "
                              f"on at least 2 nodes)")

    @property
    def model_path(self) -> Path:
        """The base model's directory on this node: ``model.path`` resolved, checked by the
        preflight. Raises ConfigError for a hub id the local Hugging Face cache lacks."""
        return base_model.resolve(self.model.path, Path(self.data_path))

    def aux_model_path(self, name: str) -> Path:
        """The directory of ``models.<name>`` on this node, resolved as :attr:`model_path` is."""
        return base_model.resolve(self.models[name].path, Path(self.data_path), f"models.{name}.path")

    def judge_template(self) -> str:
        """The judge's prompt template: judge.template's file (a relative path is under
        --data-path), or the built-in one; ConfigError when the file cannot be read or is not
        a template of the judge's fields (plugins/judge.py)."""
        from orchestrator.plugins import judge

        if not self.judge.template:
            return judge.DEFAULT_TEMPLATE
        path = Path(self.data_path) / self.judge.template
        try:
            template = path.read_text(encoding="utf-8")
            judge.check_template(template, f"judge.template={self.judge.template} ({path})")
        except OSError as e:
            raise ConfigError(f"judge.template={self.judge.template}: cannot read {path} ({e.strerror or e}): give a text file "
                              f"(a relative path is under --data-path), or unset it for the built-in template") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return template

    def task_file(self, split: str) -> Path:
        """The task file of ``split`` ("train" or "eval"): ``data.train_file`` or ``data.test_file``."""
        name = self.data.train_file if split == "train" else self.data.test_file
        return Path(self.data_path) / name  # an absolute name stays as it is

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def fingerprint(self) -> dict:
        """What every rank of one run must agree on; compared when ranks join an attempt."""
        return {
            "num_nodes": self.num_nodes,
            "rank_weights": "auto" if self.rank_weights is None else list(self.rank_weights),
            "elastic": self.coordination.elastic,
            "rl_phase": self.rl_phase.value,
            "eval_interval": self.eval_interval,
            "rollout_split": self.rollout_split.value if self.rollout_split else None,
            "max_iterations": self.max_iterations,
            "workload": self.workload.value,
            "seed": self.seed,
            "max_staleness": self.rl.max_staleness,
            "rehearsal": dataclasses.asdict(self.rehearsal) if self.workload is WorkloadKind.REHEARSAL else None,
            # The files, not only the key: ranks whose model.path resolves to other files are refused at join.
            "model": base_model.identity(self.model_path) if self.workload is WorkloadKind.RL else None,
            "rl": dataclasses.asdict(self.rl) if self.workload is WorkloadKind.RL else None,
            "data": dataclasses.asdict(self.data) if self.workload is WorkloadKind.RL else None,
            "train": dataclasses.asdict(self.train),
            "rollout": {k: v for k, v in dataclasses.asdict(self.rollout).items() if k not in ("engine_url", "engine_start_timeout_s")},
            "judge": dataclasses.asdict(self.judge) if self.workload is WorkloadKind.RL else None,
            "models": {name: base_model.identity(self.aux_model_path(name)) for name in sorted(self.models)}
            if self.workload is WorkloadKind.RL else None,
            # Not `checkpoint`: only the master removes checkpoints, so the workers' values are never
            # used, and a rerun may change them (keep fewer when the disk fills) without a mismatch.
        }


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --- dotted overrides -------------------------------------------------------------------

_TOP_LEVEL_OVERRIDABLE = ("seed",)
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@functools.cache
def _section_classes() -> dict[str, type]:
    """RunConfig's sections by key prefix: its fields whose type is a dataclass."""
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])}


MODEL_KEY = "models.<name>."
"""How the keys of a models.<name> section are listed (``orchestrator config``)."""


@functools.cache
def _override_types() -> dict[str, object]:
    """Every key an override may set, in the order ``valid keys`` lists them, with the type its
    value is read as: the fields' own types, their constraints left for the section to check
    once it is built (so a bound is refused in its own words, not as a bad value)."""
    top = typing.get_type_hints(RunConfig)
    keys = {name: top[name] for name in _TOP_LEVEL_OVERRIDABLE}
    for section, cls in _section_classes().items():
        keys.update((f"{section}.{name}", ftype) for name, ftype in typing.get_type_hints(cls).items())
    keys.update((MODEL_KEY + name, ftype) for name, ftype in typing.get_type_hints(AuxModelConfig).items())
    return keys


def valid_override_keys() -> list[str]:
    return list(_override_types())


def override_fields() -> dict[str, tuple[type, dataclasses.Field, object]]:
    """Each key of ``valid_override_keys()``, in its order, with the dataclass that declares
    it, its field and its type with the constraints (for ``describe_type``): what
    ``orchestrator config`` describes."""
    def of(cls: type, names) -> list[tuple[str, tuple[type, dataclasses.Field, object]]]:
        hints = typing.get_type_hints(cls, include_extras=True)
        return [(f.name, (cls, f, hints[f.name])) for f in dataclasses.fields(cls) if f.name in names]

    fields = dict(of(RunConfig, _TOP_LEVEL_OVERRIDABLE))
    for section, cls in _section_classes().items():
        fields.update((f"{section}.{name}", entry) for name, entry in of(cls, {f.name for f in dataclasses.fields(cls)}))
    fields.update((MODEL_KEY + name, entry) for name, entry in of(AuxModelConfig, {f.name for f in dataclasses.fields(AuxModelConfig)}))
    return fields


def describe_type(hint) -> str:
    """A field's type with the constraints the validator checks, as a reader wants them:
    ``int >= 1``, ``float in (0, 1]``, ``ddp|fsdp``, ``str, non-empty``, ``list[str]``."""
    meta = _meta(hint)
    name = _type_name(hint)
    if meta is None:
        return name
    # _one_of's pattern, \A(?:a|b)\Z: its values read better than "str".
    choices = re.fullmatch(r"\\A\(\?:(.*)\)\\Z", meta.pattern or "")
    if choices:
        return "|".join(re.sub(r"\\(.)", r"\1", v) for v in choices.group(1).split("|"))
    bounds = _bounds(meta)
    return f"{name} {bounds}" if bounds else f"{name}, non-empty" if meta.min_length == 1 else name


def _type_name(hint) -> str:
    """``float`` for ``Annotated[float, ...] | None``; ``list[str]`` for a list of them."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _type_name(next(a for a in typing.get_args(hint) if a is not type(None)))
    if typing.get_origin(hint) is Annotated:
        return _type_name(typing.get_args(hint)[0])
    if typing.get_origin(hint) is list:
        return f"list[{_type_name(typing.get_args(hint)[0])}]"
    if typing.get_origin(hint) is dict:
        return "JSON object"
    return getattr(hint, "__name__", str(hint))


def closest_keys(key: str, n: int = 3) -> list[str]:
    """Up to ``n`` valid keys a misspelt ``key`` may have meant: the closest whole keys, then
    the keys whose name (after the section) is close to its name (``lr``: ``rl.lr``)."""
    import difflib

    keys = valid_override_keys()
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(k.rpartition(".")[2], []).append(k)
    for name in difflib.get_close_matches(key.rpartition(".")[2], list(by_name), n=n, cutoff=0.75):
        close += [k for k in by_name[name] if k not in close]
    return close[:n]


def unknown_key_hint(key: str) -> str:
    """What to say after "unknown config key": the closest keys, else where to find them."""
    close = closest_keys(key)
    if close:
        head, last = close[:-1], close[-1]
        return f"did you mean {', '.join(head) + ' or ' if head else ''}{last}? (`orchestrator config` lists every key)"
    section = key.partition(".")[0] if "." in key else None
    if section in _section_classes():
        return f"{section} has no such key: `orchestrator config {section}` lists its keys"
    return (f"keys are SECTION.NAME (or {', '.join(_TOP_LEVEL_OVERRIDABLE)}) with sections {', '.join(_section_classes())}; "
            f"`orchestrator config` lists every key")


def parse_overrides(items: typing.Iterable[str]) -> dict[str, dict[str, object] | object]:
    """Turn ``["coordination.node_timeout_s=30", ...]`` into typed values per section."""
    types_ = _override_types()
    sections: dict[str, dict[str, object]] = {section: {} for section in _section_classes()}
    top: dict[str, object] = {}
    models: dict[str, dict[str, object]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            if item.strip() in types_:
                raise ConfigError(f"override {item!r} is not key=value: give {item.strip()}=VALUE "
                                  f"(`orchestrator config {item.strip()}` shows its type and default)")
            raise ConfigError(f"override {item!r} is not key=value, e.g. rl.lr=1e-5 (`orchestrator config` lists every key)")
        key = key.strip()
        model = re.fullmatch(r"models\.([^.]+)\.([^.]+)", key)
        if model is not None and MODEL_KEY + model.group(2) in types_:  # models.<name>.<key>: a section per name
            models.setdefault(model.group(1), {})[model.group(2)] = _coerce(key, raw, types_[MODEL_KEY + model.group(2)])
            continue
        if key not in types_ or key.startswith(MODEL_KEY):
            raise ConfigError(f"unknown config key {key!r}: {unknown_key_hint(key)}")
        section, _, name = key.rpartition(".")
        (sections[section] if section else top)[name] = _coerce(key, raw, types_[key])
    return {"sections": sections, "top": top, "models": models}


def _coerce(key: str, raw: str, ftype) -> object:
    """The command line's text as a value of the field's type. A list is JSON, decoded and
    type-checked by msgspec (or one bare string). A number is read by its type's own
    constructor, which takes ``+5``, ``.5`` and ``1_000`` as it always has (msgspec's lax
    reading of text refuses those and reads ``5.0`` as an int); a bool by ``_BOOLEANS``."""
    raw = raw.strip()
    if typing.get_origin(ftype) in (typing.Union, types.UnionType):
        ftype = next(a for a in typing.get_args(ftype) if a is not type(None))
    if typing.get_origin(ftype) is list:
        try:
            return msgspec.json.decode(raw, type=ftype) if raw.startswith("[") else [raw]
        except msgspec.MsgspecError:
            raise ConfigError(f"{key}={raw!r}: expected a JSON list of strings, e.g. {key}='[\"a\", \"b\"]', or one string") from None
    if typing.get_origin(ftype) is dict:
        try:
            return msgspec.json.decode(raw or "{}", type=ftype)
        except msgspec.MsgspecError:
            raise ConfigError(f"{key}={raw!r}: expected a JSON object, e.g. {key}='{{\"name\": 1}}'") from None
    try:
        return _BOOLEANS[raw.lower()] if ftype is bool else ftype(raw)
    except (KeyError, ValueError):
        raise ConfigError(f"{key}={raw!r}: expected a value of type {ftype.__name__}") from None


def build_sections(overrides: dict) -> dict[str, object]:
    classes = _section_classes()
    built: dict[str, object] = {name: classes[name](**values) for name, values in overrides["sections"].items()}
    built.update(overrides["top"])
    built["models"] = {name: AuxModelConfig(**values) for name, values in overrides.get("models", {}).items()}
    return built
