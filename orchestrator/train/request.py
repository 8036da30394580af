"""The request the orchestrator writes for one update (JSON, one file per train worker and
iteration): ``TrainRequest``. What this iteration's update starts from and makes (the released
training plan's paths, the seed), and the run's own settings of the update (``rl``) and of the
train workers (``train``), under the run's key names and with its types (train/settings.py):
a value the run refuses is refused here alike, named by its key, so the rank's error says
which one to fix."""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Annotated

import msgspec

from orchestrator.train.errors import BadTrainInput
from orchestrator.train.settings import TrainerSettings, UpdateSettings

log = logging.getLogger(__name__)

SECTIONS = {"rl": UpdateSettings, "train": TrainerSettings}


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """An iteration trained again from its durable aggregate, as it was trained the first time."""

    iteration: Annotated[int, msgspec.Meta(ge=1)]
    data: Path
    seed: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainRequest:
    """Built by ``from_json`` or ``read``, which check every field's type and bounds (msgspec)."""

    iteration: Annotated[int, msgspec.Meta(ge=0)]
    """The RL iteration this update belongs to (for logs and stats)."""
    data: Path
    """The trajectory aggregate (.jsonl), one record per task (format: ``grpo``)."""
    init_checkpoint: Path
    """Hugging Face directory the policy starts from; also the 'old' policy of the ratio."""
    init_iteration: int | None = None
    """The iteration whose update ``init_checkpoint`` holds (None: the base model). A serving
    trainer that made that update continues from memory instead of loading it."""
    reference_checkpoint: Path | None
    """Hugging Face directory of the KL reference, or None for no KL term."""
    output: Path
    """Staging directory for the new checkpoint (rank 0 writes it)."""
    seed: int
    """Seeds torch and the per-epoch shuffle (same on every rank)."""
    publish_dtype: Annotated[str, msgspec.Meta(pattern=r"\A(?:auto|bfloat16|float16|float32)\Z")] = "auto"
    """The dtype of the weights written for the engines (auto: the dtype they serve, the init
    checkpoint's); other than the master's, the fp32 master goes to ``master/`` beside them."""
    write_state: bool = True
    """Write the training state (the fp32 master weights, when the published ones are not
    they, and the optimizer state) into the checkpoint; without it the checkpoint holds the
    published weights only (checkpoint.state_every)."""
    replay: tuple[ReplayStep, ...] = ()
    """When ``init_checkpoint`` holds no training state: the iterations after ``replay_from``
    up to ``init_iteration``, trained again (in order) by a trainer that does not hold
    ``init_iteration`` in memory, to reach the state the init checkpoint would have held."""
    replay_from: Path | None = None
    """The checkpoint with the state the replay starts from (or the base model's directory)."""
    replay_from_iteration: int | None = None
    """Its iteration (None: the base model)."""
    publish_delta: bool = False
    """Write the weights as a delta against the init checkpoint's where that is smaller
    (checkpoints/deltas.py); whole every ``publish_full_every`` iterations."""
    publish_full_every: Annotated[int, msgspec.Meta(ge=1)] = 10
    """Iterations divisible by it publish their weights whole."""
    parallel_write: bool = True
    """Every worker writes its part of the checkpoint, in parallel (false: worker 0 writes it all)."""
    offload: bool = False
    """After the update, move the model and optimizer state to host memory (and back at the
    next request), so that engines sharing the GPU have its memory while they run."""
    base_model: Path | None = None
    """With LoRA: the base model's directory on this node, which ``init_checkpoint`` (an
    adapter, after the first iteration) applies to."""
    rl: UpdateSettings = field(default_factory=UpdateSettings)
    """The run's ``rl.*`` keys of the update, ``rl.is_correction`` resolved."""
    train: TrainerSettings = field(default_factory=TrainerSettings)
    """The run's ``train.*`` keys of how the workers compute."""

    def __post_init__(self) -> None:
        if self.train.lora_rank and self.base_model is None:
            raise ValueError("train.lora_rank > 0 needs base_model, the directory the adapters apply to")

    @property
    def correction(self) -> str:
        """rl.is_correction as the trainer applies it (``auto`` is the run's to resolve: none here)."""
        return "none" if self.rl.is_correction == "auto" else self.rl.is_correction

    @property
    def uses_kl(self) -> bool:
        return self.rl.kl_coef > 0 and self.reference_checkpoint is not None

    @property
    def engine_logprobs_needed(self) -> str | None:
        """What needs each sample's engine log-probs, or None."""
        if self.rl.old_logprobs == "engine":
            return "old_logprobs=engine"
        if self.correction != "none":
            return f"is_correction={self.correction}"
        if self.rl.distill_coef > 0:  # the teacher's term is the teacher's log-prob less the engine's
            return f"distill_coef={self.rl.distill_coef:g}"
        return None

    @classmethod
    def from_json(cls, raw: object) -> "TrainRequest":
        """Raises ValueError naming the key at fault."""
        if not isinstance(raw, dict):
            raise ValueError("the train request is not a JSON object")
        missing = [f.name for f in fields(cls) if f.name not in raw and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"the train request lacks {', '.join(missing)}")
        _check_each_key(raw, cls, "")
        for name, section in SECTIONS.items():
            if name in raw:
                if not isinstance(raw[name], dict):
                    raise ValueError(f"the train request's {name!r} is not an object of {name}.* keys")
                _check_each_key(raw[name], section, f"{name}.")
        try:
            request = msgspec.convert(raw, cls, dec_hook=_absolute_path)
            request.rl.check()
            request.train.check()
        except msgspec.ValidationError as e:
            raise ValueError(f"the train request: {e}") from None
        return request

    @classmethod
    def read(cls, path: Path) -> "TrainRequest":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls.from_json(raw)
        except (OSError, ValueError) as e:
            raise BadTrainInput(f"train request {path}: {e}") from None

    def to_json(self) -> dict:
        """The request as JSON values (paths as strings), as ``from_json`` reads it back."""
        return msgspec.to_builtins(self, enc_hook=str)


def of(**values) -> dict:
    """A train request as JSON from flat keyword values: those of ``rl`` and ``train`` go into
    their sections (for callers that set a few, like the benchmarks and tests)."""
    out: dict = {"rl": {}, "train": {}}
    names = {name: {f.name for f in dataclasses.fields(section)} for name, section in SECTIONS.items()}
    for key, value in values.items():
        section = next((s for s, known in names.items() if key in known), None)
        if section is None:
            out[key] = value
        else:
            out[section][key] = value
    return out


def _check_each_key(raw: dict, cls: type, prefix: str) -> None:
    """Decode each known key of ``raw`` on its own, in the order ``raw`` has them (the order
    msgspec meets them in), so the first bad one is named by its key; unknown keys are logged."""
    types = typing.get_type_hints(cls, include_extras=True)
    unknown = sorted(k for k in raw if k not in types)
    if unknown:
        log.warning("ignoring unknown train request keys: %s", ", ".join(prefix + k for k in unknown))
    for name, value in raw.items():
        if name not in types or (not prefix and name in SECTIONS):
            continue
        try:
            msgspec.convert(value, types[name], dec_hook=_absolute_path)
        except msgspec.ValidationError as e:
            raise ValueError(f"train request key {prefix + name!r} is {value!r}: {e}") from None


def _absolute_path(type_: type, value: object) -> Path:
    """msgspec's decoder of the ``Path`` fields: absolute paths only."""
    if type_ is not Path:
        raise NotImplementedError(type_)
    if not isinstance(value, str):
        raise TypeError(f"Expected `str`, got `{type(value).__name__}`")
    if not Path(value).is_absolute():
        raise ValueError("must be an absolute path")
    return Path(value)
