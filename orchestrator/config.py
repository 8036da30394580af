"""Typed run configuration: nested dataclasses, validated on construction.

Flags of ``orchestrator run`` (SPEC section 2) fill the top level; every nested field is a
dotted key a user can override on the command line (``coordination.node_timeout_s=30``).
Validation raises :class:`ConfigError`, which the CLI turns into exit code 2 before
anything is written under ``--log-path``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from orchestrator import defaults
from orchestrator.errors import ConfigError
from orchestrator.phase_table import PHASE_TABLE, Phase, RLPhase


class RolloutSplit(enum.Enum):
    TRAIN_ONLY = "train-only"
    EVAL_ONLY = "eval-only"


class Workload(enum.Enum):
    REHEARSAL = "rehearsal"
    RL = "rl"


@dataclass(kw_only=True, slots=True)
class CoordinationConfig:
    heartbeat_interval_s: float = 5.0
    """How often each rank rewrites its heartbeat counter. At most node_timeout_s / 4."""
    node_timeout_s: float = defaults.NODE_TIMEOUT_S
    """A rank whose heartbeat counter has not changed for this long (on the reader's own
    monotonic clock) is dead. Must exceed the filesystem's cache window (NFS attributes up to
    60 s, blobfuse2 120 s by default), GC pauses and server stalls."""
    join_timeout_s: float = 900.0
    """How long ranks wait for every rank to join an attempt before failing, naming the absent."""
    master_wait_s: float | None = None
    """After the master dies, how long the workers wait for a new one (restart only rank 0
    with the same command) before they exit; 0: they exit at once (exit 3) and every node
    is re-run. Unset: join_timeout_s with elastic (a run that goes on without a node also
    waits for its master), else 0."""
    poll_min_s: float = 0.002
    """First poll interval of a wait; it doubles up to poll_max_s."""
    poll_max_s: float = 0.1
    """Longest interval between two polls of a known file name."""
    work_stealing: bool = True
    """Rollout and eval tasks go out in chunks; a rank that has finished its own takes chunks
    not yet started from the rank with the most left, so a phase ends when its work ends.
    --rank-weights sets the first split. Off: each rank does exactly its weighted share."""
    chunk_tasks: int = 0
    """Tasks per chunk with work stealing; 0: about 32 chunks per rank (never smaller than
    what one engine request carries)."""
    elastic: bool = False
    """A worker that dies or freezes is marked out within node_timeout_s and the run goes on
    without it (its unsealed rollout and eval work done by the others; lost mid-training, the
    others train that step again without it); the same command on that node rejoins at the
    next iteration's start, and workers wait for a restarted master (master_wait_s). Off: a dead worker ends the attempt on
    every rank (exit 3). Off by default: training then runs on fewer workers, whose shards of
    the model and optimizer are larger than the ones the run was sized for."""
    min_nodes: int = 1
    """With elastic: the fewest ranks the run goes on with; losing one more ends the attempt."""

    @property
    def master_wait(self) -> float:
        """Seconds workers wait for a restarted master (master_wait_s, or its default)."""
        if self.master_wait_s is not None:
            return self.master_wait_s
        return self.join_timeout_s if self.elastic else 0.0

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ConfigError(f"coordination.min_nodes must be at least 1, got {self.min_nodes}")
        if self.chunk_tasks < 0:
            raise ConfigError(f"coordination.chunk_tasks must be >= 0 (0: automatic), got {self.chunk_tasks}")
        if self.master_wait_s is not None and self.master_wait_s < 0:
            raise ConfigError(f"coordination.master_wait_s must be >= 0 seconds, got {self.master_wait_s}")
        for name in ("heartbeat_interval_s", "node_timeout_s", "join_timeout_s", "poll_min_s", "poll_max_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"coordination.{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.heartbeat_interval_s * 4 > self.node_timeout_s:
            raise ConfigError(
                f"coordination.heartbeat_interval_s ({self.heartbeat_interval_s}) must be at most a quarter of "
                f"coordination.node_timeout_s ({self.node_timeout_s}), or a live rank can look dead"
            )
        if self.poll_min_s > self.poll_max_s:
            raise ConfigError(f"coordination.poll_min_s ({self.poll_min_s}) must not exceed poll_max_s ({self.poll_max_s})")


def _deadline_fields() -> list[tuple[str, type, dataclasses.Field]]:
    return [(p.name.lower(), float, field(default=PHASE_TABLE[p].deadline_s)) for p in Phase]


def _validate_deadlines(self) -> None:
    for f in dataclasses.fields(self):
        if getattr(self, f.name) <= 0:
            raise ConfigError(f"deadlines.{f.name} must be a positive number of seconds, got {getattr(self, f.name)}")


DeadlineConfig = dataclasses.make_dataclass(
    "DeadlineConfig",
    _deadline_fields(),
    namespace={
        "__post_init__": _validate_deadlines,
        "__doc__": "Seconds each phase (its work and its barrier) may take, one key per phase.",
        "for_phase": lambda self, phase: getattr(self, phase.name.lower()),
    },
    kw_only=True,
    slots=True,
)


@dataclass(kw_only=True, slots=True)
class RehearsalConfig:
    tasks: int = 24
    """Rollout tasks per iteration, split over the ranks by weight."""
    eval_tasks: int = 8
    """Eval tasks per evaluated iteration."""
    work_s: float = 0.2
    """Simulated seconds of work in each working phase (rollout, eval, train)."""
    record_bytes: int = 256
    """Payload bytes per simulated trajectory record."""
    task_s: float = 0.0
    """Simulated seconds per rollout or eval task; 0: a rank's first share takes work_s."""
    slow_ranks: str = ""
    """``"R:F,..."``: rank R takes F times longer per task (a slow node, to rehearse work stealing)."""

    def __post_init__(self) -> None:
        if self.task_s < 0:
            raise ConfigError(f"rehearsal.task_s must be >= 0, got {self.task_s}")
        self.slowdown  # validates rehearsal.slow_ranks
        if self.tasks < 1 or self.eval_tasks < 1:
            raise ConfigError(f"rehearsal.tasks and rehearsal.eval_tasks must be at least 1, got {self.tasks}, {self.eval_tasks}")
        if self.work_s < 0:
            raise ConfigError(f"rehearsal.work_s must be >= 0, got {self.work_s}")
        if self.record_bytes < 0:
            raise ConfigError(f"rehearsal.record_bytes must be >= 0, got {self.record_bytes}")

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


# The update's hyper-parameters and their bounds: the rl.* keys below and the trainer's config
# (train/worker.py TrainConfig, which msgspec decodes) both take their types from here.
LearningRate = Annotated[float, msgspec.Meta(gt=0)]
Epochs = Annotated[int, msgspec.Meta(ge=1)]
MicroBatch = Annotated[int, msgspec.Meta(ge=1)]
MicroBatchTokens = Annotated[int, msgspec.Meta(ge=0)]
ClipEps = Annotated[float, msgspec.Meta(gt=0)]
KLCoef = Annotated[float, msgspec.Meta(ge=0)]
MaxGradNorm = Annotated[float, msgspec.Meta(gt=0)]
MaxPromptTokens = Annotated[int, msgspec.Meta(ge=0)]


def _bounds(hint) -> str:
    """``"> 0"`` for ``Annotated[float, msgspec.Meta(gt=0)]``; empty for a type without bounds."""
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    metas = [m for m in typing.get_args(hint)[1:] if isinstance(m, msgspec.Meta)]
    return " and ".join(f"{op} {getattr(m, k)}" for m in metas for k, op in ops.items() if getattr(m, k) is not None)


def _out_of_bounds(obj) -> typing.Iterator[tuple[str, str]]:
    """``(name, "must be > 0, got -1.0")`` for each field of dataclass ``obj`` outside its type's bounds."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        if _bounds(hints[f.name]):
            try:
                msgspec.convert(getattr(obj, f.name), hints[f.name])
            except msgspec.ValidationError:
                yield f.name, f"must be {_bounds(hints[f.name])}, got {getattr(obj, f.name)!r}"


@dataclass(kw_only=True, slots=True)
class RLConfig:
    train_tasks: int = 384
    """Train tasks (prompts) per iteration, sampled from tasks/train.jsonl, split by weight."""
    samples_per_prompt: int = 8
    """Completions drawn per prompt: one GRPO group."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 8
    """Longest completion, in tokens."""
    max_prompt_tokens: MaxPromptTokens = 0
    """Tasks whose prompt (as the engine sees it: rendered, special tokens included) is longer
    than this many tokens are left out of the run, with a count in the log and in every
    iteration's summary. 0: the model's context length minus rl.max_tokens."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (cut from its text), besides every EOS id of the model's
    generation_config. On the command line a JSON list, rl.stop='["</answer>", "\\n\\n"]', or one string."""
    eval_tasks: int = 200
    """Eval tasks, the first of tasks/test.jsonl: the same set every evaluated iteration."""
    eval_samples: int = 4
    """Completions per eval task: accuracy is their mean reward, pass@k their best."""
    eval_temperature: float = 0.5
    reward: str = "orchestrator.rewards:exact_match"
    """The reward function, as module:function (task dict, completion text) -> float."""
    max_reward_error_fraction: float = 0.01
    """A sample whose reward raises scores 0; a rank fails when more than this share of the
    samples of its rollout failed."""
    lr: LearningRate = 3e-4
    """AdamW learning rate; the optimizer's moments carry over from one iteration to the next."""
    epochs: Epochs = 4
    """Passes over the iteration's trajectories per update."""
    micro_batch: MicroBatch = 48
    """Prompts (GRPO groups) per optimiser step, over all train workers: the update does not
    depend on how many there are (train/plan.py). Each worker accumulates its part of a step
    in micro-batches of train.micro_batch_tokens."""
    clip_eps: ClipEps = 0.2
    kl_coef: KLCoef = 0.0
    """Weight of the KL penalty to the base model (0: none)."""
    max_grad_norm: MaxGradNorm = 1.0
    train_on_partial: bool = False
    """Train on an aggregate that `orchestrator recover --salvage` marked partial (some
    planned tasks missing). Off: such an iteration is refused in phase 8."""
    train_port: int = 29500
    """First TCP port the master tries for the training rendezvous."""
    train_timeout_s: float = 600.0
    """Collective timeout of the training process group: a lost peer fails the step."""

    def __post_init__(self) -> None:
        for name in ("train_tasks", "samples_per_prompt", "max_tokens", "eval_tasks", "eval_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name} must be at least 1, got {getattr(self, name)}")
        for name, problem in _out_of_bounds(self):
            raise ConfigError(f"rl.{name} {problem}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"rl.stop must be non-empty strings, got {self.stop!r}")
        if not 0 <= self.max_reward_error_fraction <= 1:
            raise ConfigError(f"rl.max_reward_error_fraction must be in [0, 1], got {self.max_reward_error_fraction}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rl.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0 or self.eval_temperature < 0:
            raise ConfigError("rl.temperature and rl.eval_temperature must be >= 0")
        from orchestrator import rewards

        try:
            rewards.parse(self.reward)  # importing it is the preflight's (it depends on the node)
        except ValueError as e:
            raise ConfigError(str(e)) from None


ENGINES = ("embedded", "vllm")
WEIGHT_UPDATES = ("auto", "restart")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the tasks come from (docs/data.md)."""

    train_file: str = "tasks/train.jsonl"
    """Train tasks, JSON lines or Parquet (.parquet); relative paths are under --data-path."""
    test_file: str = "tasks/test.jsonl"
    """Eval tasks, in the same formats."""
    prompt_key: str = "prompt"
    """The column of the prompt: a string, or a list of chat messages rendered with the model's chat template."""
    answer_key: str = "answer"
    """The column of the reference answer the reward compares with."""
    id_key: str = "id"
    """The column of a task's unique id; a file without it numbers its rows (1, 2, ...)."""
    system_prompt: str = ""
    """A system message put before every prompt (a string prompt then becomes the user's
    message); both go through the chat template."""

    def __post_init__(self) -> None:
        for name in ("train_file", "test_file", "prompt_key", "answer_key", "id_key"):
            if not getattr(self, name):
                raise ConfigError(f"data.{name} must not be empty")
        for name in ("train_file", "test_file"):
            if Path(getattr(self, name)).suffix not in (".jsonl", ".json", ".parquet"):
                raise ConfigError(f"data.{name}={getattr(self, name)!r}: task files are JSON lines (.jsonl) or Parquet (.parquet)")


STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")


@dataclass(kw_only=True, slots=True)
class TrainPlacementConfig:
    device_mapping: str = ""
    """Global GPU ranks of the train workers, one GPU each: "0-15", "0,1,2,3" (empty: CPU, one
    worker per node). See docs/placement.md."""
    keep_alive: bool = True
    """One trainer process per train worker for the whole attempt: it forms the process group
    once and keeps the model and the optimizer in memory across iterations. false: a new
    trainer process per iteration, which loads the checkpoint (weights and optimizer state)."""
    strategy: str = "ddp"
    """"ddp": every train worker holds the whole model, gradients and optimizer state. "fsdp":
    FSDP2, each holds 1/N of them, and the checkpoint is written as one shard per worker
    (docs/training.md)."""
    mixed_precision: str = "fp32"
    """"bf16": compute in bfloat16, with fp32 master weights, gradient reduction and optimizer state."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them."""
    micro_batch_tokens: int = 16384
    """Most tokens (padding included) in one micro-batch; a worker accumulates gradients over
    as many as its part of an optimizer step needs. 0: its whole part at once. The update is
    the same whatever this is (the loss is the token mean over the whole step)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"train.strategy={self.strategy!r}: valid strategies are {', '.join(STRATEGIES)}")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(f"train.mixed_precision={self.mixed_precision!r}: valid values are {', '.join(PRECISIONS)}")
        if self.micro_batch_tokens < 0:
            raise ConfigError(f"train.micro_batch_tokens must be >= 0 (0: no limit), got {self.micro_batch_tokens}")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: str = "embedded"
    """Inference engine: "embedded" (this package's server, CPU) or "vllm"."""
    device_mapping: str = ""
    """Global GPU ranks of the inference engines (empty: CPU, one engine per node)."""
    gpus_per_engine: int = 1
    """GPUs per engine: tensor_parallel_size x pipeline_parallel_size."""
    pipeline_parallel_size: int = 1
    """vLLM pipeline stages per engine; tensor parallel size is gpus_per_engine / this."""
    engine_port: int = 8000
    """Port of a node's first engine; its next engines take the next ports (the first free one
    from there at start)."""
    engine_url: str = "http://127.0.0.1:8000"
    """With --debug-mode: the engine already running, used as it is."""
    engine_start_timeout_s: float = 300.0
    gpu_memory_utilization: float = 0.9
    """vLLM: fraction of each GPU's memory the engine may take."""
    max_model_len: int = 0
    """vLLM: longest sequence (0: the model's own)."""
    dtype: str = "auto"
    """vLLM: weight dtype (float32 on CPU)."""
    engine_args: str = ""
    """vLLM: more serve arguments, as one shell-quoted string (e.g. "--enforce-eager")."""
    weight_update: str = "auto"
    """How a running engine moves to a new checkpoint: "auto" reloads the weights in place
    (vLLM's reload_weights) and restarts when that fails; "restart" always restarts."""
    memory_release_timeout_s: float = 120.0
    """Colocated GPUs: how long training waits for the engines' GPU memory to be released."""
    memory_released_mib: int = 2048
    """Colocated GPUs: memory in use per GPU below which it counts as released."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"rollout.engine={self.engine!r}: valid engines are {', '.join(ENGINES)}")
        if self.weight_update not in WEIGHT_UPDATES:
            raise ConfigError(f"rollout.weight_update={self.weight_update!r}: valid values are {', '.join(WEIGHT_UPDATES)}")
        if self.gpus_per_engine < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("rollout.gpus_per_engine and rollout.pipeline_parallel_size must be at least 1")
        if self.gpus_per_engine % self.pipeline_parallel_size:
            raise ConfigError(
                f"rollout.pipeline_parallel_size={self.pipeline_parallel_size} does not divide rollout.gpus_per_engine="
                f"{self.gpus_per_engine} (tensor parallel size = gpus_per_engine / pipeline_parallel_size)"
            )
        if not 0 <= self.engine_port <= 65535:
            raise ConfigError(f"rollout.engine_port must be a TCP port (0-65535), got {self.engine_port}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len < 0:
            raise ConfigError(f"rollout.max_model_len must be >= 0, got {self.max_model_len}")
        for name in ("engine_start_timeout_s", "memory_release_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"rollout.{name} must be a positive number of seconds")

    @property
    def tensor_parallel_size(self) -> int:
        return self.gpus_per_engine // self.pipeline_parallel_size


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Which iteration checkpoints the master keeps (data/retention.py). Whatever these say,
    the current checkpoint and every checkpoint a consumer marker names are kept too."""

    keep_last: int = 3
    """The newest checkpoints kept, the current one among them; at least 1."""
    keep_every: int = 0
    """Also keep the checkpoint of every iteration divisible by this (0: none kept for that reason)."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be at least 1 (the current checkpoint is always kept), got {self.keep_last}")
        if self.keep_every < 0:
            raise ConfigError(f"checkpoint.keep_every must be >= 0 (0: none kept for that reason), got {self.keep_every}")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    data_path: Path
    log_path: Path
    rl_phase: RLPhase
    rank: int
    num_nodes: int = 1
    rank_weights: tuple[float, ...] | None = (1.0,)
    """Each node's share of rollout and eval; None: ``--rank-weights auto`` (by the GPUs of
    each node's engines, known once the nodes report theirs)."""
    eval_interval: int | None = None
    rollout_split: RolloutSplit | None = None
    max_iterations: int | None = None
    workload: Workload = Workload.RL
    debug_mode: bool = False
    seed: int = 0
    """Seeds task sampling and everything random in the run."""
    coordination: CoordinationConfig = field(default_factory=CoordinationConfig)
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)  # type: ignore[valid-type]
    rehearsal: RehearsalConfig = field(default_factory=RehearsalConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainPlacementConfig = field(default_factory=TrainPlacementConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        for name in ("data_path", "log_path"):
            if not Path(getattr(self, name)).is_absolute():
                raise ConfigError(f"--{name.replace('_', '-')} must be an absolute path (the same on every node), got {getattr(self, name)!s}")
        if self.num_nodes < 1:
            raise ConfigError(f"--num-nodes must be at least 1, got {self.num_nodes}")
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
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError(f"--eval-interval must be at least 1, got {self.eval_interval}")
        if self.rl_phase is RLPhase.ROLLOUT and self.rollout_split is None:
            raise ConfigError("--rl-phase rollout needs --rollout-split train-only|eval-only")
        if self.max_iterations is not None and self.max_iterations < 1:
            raise ConfigError(f"--max-iterations must be at least 1, got {self.max_iterations}")
        if any(r >= self.num_nodes for r in self.rehearsal.slowdown):
            raise ConfigError(f"rehearsal.slow_ranks={self.rehearsal.slow_ranks!r} names a rank outside 0..{self.num_nodes - 1}")
        from orchestrator.node import placement

        placement.check_mappings(self.train.device_mapping, self.rollout.device_mapping, self.rollout.gpus_per_engine)
        if not self.train.device_mapping and self.rank_weights is not None and 0 in self.rank_weights:
            raise ConfigError(f"--rank-weights gives node {self.rank_weights.index(0)} weight 0, but without a device mapping every "
                              f"node runs an engine and rolls out: give every node a positive weight, or auto")
        if self.workload is Workload.RL and self.rollout.engine == "vllm" and not self.debug_mode:
            for temp, n, what in ((self.rl.temperature, self.rl.samples_per_prompt, "rl.temperature/rl.samples_per_prompt"),
                                  (self.rl.eval_temperature, self.rl.eval_samples, "rl.eval_temperature/rl.eval_samples")):
                if temp == 0 and n > 1:
                    raise ConfigError(f"{what} = 0/{n}: vLLM refuses more than one sample per prompt at temperature 0 "
                                      f"(greedy sampling gives one answer); raise the temperature or use 1 sample")

    @property
    def model_path(self) -> Path:
        """The base model: a Hugging Face directory under --data-path."""
        return Path(self.data_path) / "model"

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
            "rehearsal": dataclasses.asdict(self.rehearsal) if self.workload is Workload.REHEARSAL else None,
            "rl": dataclasses.asdict(self.rl) if self.workload is Workload.RL else None,
            "data": dataclasses.asdict(self.data) if self.workload is Workload.RL else None,
            "train": dataclasses.asdict(self.train),
            "rollout": {k: v for k, v in dataclasses.asdict(self.rollout).items() if k not in ("engine_url", "engine_start_timeout_s")},
            # Not `checkpoint`: only the master removes checkpoints, so the workers' values are never
            # used, and a rerun may change them (keep fewer when the disk fills) without a mismatch.
        }


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# --- dotted overrides -------------------------------------------------------------------

_SECTIONS = ("coordination", "deadlines", "rehearsal", "rl", "data", "train", "rollout", "checkpoint")
_TOP_LEVEL_OVERRIDABLE = ("seed",)
_SECTION_CLASSES = {
    "coordination": CoordinationConfig,
    "deadlines": DeadlineConfig,
    "rehearsal": RehearsalConfig,
    "rl": RLConfig,
    "data": DataConfig,
    "train": TrainPlacementConfig,
    "rollout": RolloutConfig,
    "checkpoint": CheckpointConfig,
}


def valid_override_keys() -> list[str]:
    keys = list(_TOP_LEVEL_OVERRIDABLE)
    defaults = _SECTION_CLASSES
    for section in _SECTIONS:
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(defaults[section])]
    return keys


def parse_overrides(items: typing.Iterable[str]) -> dict[str, dict[str, object] | object]:
    """Turn ``["coordination.node_timeout_s=30", ...]`` into typed values per section."""
    valid = valid_override_keys()
    sections: dict[str, dict[str, object]] = {s: {} for s in _SECTIONS}
    top: dict[str, object] = {}
    classes = _SECTION_CLASSES
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value; valid keys: {', '.join(valid)}")
        key = key.strip()
        if key not in valid:
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid)}")
        if "." in key:
            section, name = key.split(".", 1)
            ftype = _field_type(classes[section], name)
            sections[section][name] = _coerce(key, raw, ftype)
        else:
            top[key] = _coerce(key, raw, int)
    return {"sections": sections, "top": top}


def _field_type(cls: type, name: str) -> type:
    hints = typing.get_type_hints(cls)
    return hints[name]


def _coerce(key: str, raw: str, ftype: type) -> object:
    raw = raw.strip()
    origin = typing.get_origin(ftype)
    if origin in (typing.Union, types.UnionType):
        ftype = next(a for a in typing.get_args(ftype) if a is not type(None))
    if origin is list:  # a JSON list of strings, or one bare string
        try:
            value = json.loads(raw) if raw.startswith("[") else [raw]
        except ValueError:
            value = None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{key}={raw!r}: expected a JSON list of strings, e.g. {key}='[\"a\", \"b\"]', or one string")
        return value
    try:
        if ftype is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return ftype(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected a value of type {ftype.__name__}") from None


def build_sections(overrides: dict) -> dict[str, object]:
    built: dict[str, object] = {name: _SECTION_CLASSES[name](**values) for name, values in overrides["sections"].items()}
    built.update(overrides["top"])
    return built


def slurm_tasks(environ: typing.Mapping[str, str] = os.environ) -> int | None:
    """``SLURM_NTASKS`` when this process runs under Slurm (None otherwise); ConfigError when
    Slurm runs more than one task on a node, since a rank is a node."""
    if "SLURM_NTASKS" not in environ:
        return None
    try:
        tasks, nodes = int(environ["SLURM_NTASKS"]), int(environ.get("SLURM_NNODES", environ["SLURM_NTASKS"]))
    except ValueError:
        raise ConfigError(f"environment SLURM_NTASKS={environ['SLURM_NTASKS']!r} or SLURM_NNODES="
                          f"{environ.get('SLURM_NNODES')!r} is not an integer") from None
    if tasks != nodes:
        raise ConfigError(f"Slurm runs SLURM_NTASKS={tasks} tasks on SLURM_NNODES={nodes} nodes, but every node runs one rank: "
                          f"start one task per node (srun --ntasks-per-node=1), or give --num-nodes and --master/--worker R")
    return tasks


def resolve_num_nodes(given: int | None, environ: typing.Mapping[str, str] = os.environ) -> int:
    """``--num-nodes``, else Slurm's task count (one task per node), else 1."""
    if given is not None:
        return given
    tasks = slurm_tasks(environ)
    return 1 if tasks is None else tasks


def resolve_rank(master: bool, worker: int | None, num_nodes: int, environ: typing.Mapping[str, str] = os.environ) -> int:
    """``--master`` is rank 0, ``--worker R`` is rank R; else ``RANK``, then ``NODE_RANK``,
    then ``SLURM_PROCID`` (with one Slurm task per node)."""
    if master and worker is not None:
        raise ConfigError("--master and --worker are exclusive: give --master on node 0 and --worker R on the others")
    if master:
        return 0
    if worker is not None:
        if worker == 0:
            raise ConfigError("--worker 0 is the master's rank: use --master on node 0 and --worker 1..N-1 elsewhere")
        return worker
    for var in ("RANK", "NODE_RANK", "SLURM_PROCID"):
        if var in environ:
            if var == "SLURM_PROCID":
                slurm_tasks(environ)
            try:
                return int(environ[var])
            except ValueError:
                raise ConfigError(f"environment {var}={environ[var]!r} is not an integer rank") from None
    if num_nodes == 1:
        return 0
    raise ConfigError(f"no rank given for a {num_nodes}-node run: pass --master (rank 0) or --worker R, or set RANK "
                      f"(srun sets SLURM_PROCID)")


def parse_weights(text: str | None, num_nodes: int) -> tuple[float, ...] | None:
    """``--rank-weights``: one number per node, or ``auto`` (None)."""
    if text is None:
        if num_nodes > 1:
            raise ConfigError(f"--rank-weights is required with --num-nodes {num_nodes}: one weight per node, e.g. "
                              f"\"{','.join(['1'] * num_nodes)}\", or auto (each node by its engines' GPUs)")
        return (1.0,)
    if text.strip() == "auto":
        return None
    try:
        return tuple(float(w) for w in text.split(","))
    except ValueError:
        raise ConfigError(f"--rank-weights must be comma-separated numbers or auto, got {text!r}") from None
