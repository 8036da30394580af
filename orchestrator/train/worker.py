"""The trainer process, one per train worker, launched by the orchestrator:

    python -m orchestrator.train.worker --train-config PATH [--done PATH]   one update, then exit
    python -m orchestrator.train.worker --serve                 one update per request, until stdin ends

The processes form a torch.distributed group over a TCP rendezvous (never ``file://``: see
SHARED-FS.md), run a GRPO update of the init checkpoint with DDP or FSDP2 (train/parallel.py),
cut into steps and micro-batches as train/plan.py says, and write the new checkpoint.

``--serve`` (``train.keep_alive``, the default) forms the group once and keeps the model, the
optimizer, the tokenizer and the KL reference across iterations. Each request is one line
on stdin, ``{"config": PATH, "done": PATH}``; when every rank has passed the update's final
barrier the process writes ``done`` (JSON: the iteration, its pid, the stats and the time
spent in each part) and waits for the next line. It continues from memory when the request's
``init_iteration`` is the update it made last, and loads the init checkpoint (weights and
optimizer state) otherwise, so a resumed run and an uninterrupted one compute the same
update. The end of stdin (its rank ended, or died: the pipe closes with it) ends the process
with 0; a failed update ends it with the exit status below, never with a half-made state
kept for the next request.

Train config (JSON, written by the orchestrator; every key without a default is required,
unknown keys are logged and ignored): see ``TrainConfig``.

Environment:
    MASTER_ADDR, MASTER_PORT    the rendezvous (rank 0 listens there)
    WORLD_SIZE, RANK            this process's place in the group
    TRAIN_BACKEND               gloo | nccl (default: nccl when CUDA is available, else gloo)
    TRAIN_TIMEOUT_S             rendezvous and collective timeout in seconds (default 600)
    LOCAL_RANK                  GPU index with nccl (default 0)
    ORCHESTRATOR_ERROR_FILE     where to write this process's error record if it fails
                                (protocol/child_error.py)

The optimizer continues from the init checkpoint's saved AdamW state when it has one
(``optimizer_state``; the base model has none, so the first iteration starts fresh).

What is written into ``output``: ``config.json``, ``generation_config.json``, the weights,
the tokenizer files, the optimizer state, and last ``train_stats.json`` (temp + rename, after
everything else, by rank 0), so ``train_stats.json`` vouches for the rest. With ddp rank 0
writes it all: ``model.safetensors`` and ``optimizer/adamw.safetensors``. With fsdp every
worker writes its shard, ``model-0000i-of-0000n.safetensors`` and
``optimizer/adamw-0000i-of-0000n.safetensors``, and rank 0 the two indexes after them
(train/sharded.py), so ``output`` must be the same directory for every worker.

Exit status: 0 done (all ranks passed the final barrier); 2 bad config, environment or
trajectory data; 1 anything else (rendezvous failed, a peer died, a collective timed out).
The last line on stderr says which rank failed and why.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from orchestrator.config import ClipEps, Epochs, KLCoef, LearningRate, MaxGradNorm, MicroBatch, MicroBatchTokens
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK
from orchestrator.protocol import child_error, fsio
from orchestrator.train import grpo, optimizer_state, parallel, plan, sharded

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
STATS_FILE = "train_stats.json"


class TrainerError(Exception):
    """A failure this process can explain; ``exit_code`` is what it exits with."""

    exit_code = EXIT_ERROR


class BadTrainInput(TrainerError):
    """The train config, the environment or the trajectory data is unusable."""

    exit_code = EXIT_BAD_INPUT


class RendezvousFailed(TrainerError):
    """The process group could not be formed (a peer never came, or the address is wrong)."""


# --- configuration -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Built by ``from_json`` or ``read``, which check every field's type and bounds (msgspec)."""

    iteration: Annotated[int, msgspec.Meta(ge=0)]
    """The RL iteration this update belongs to (for logs and stats)."""
    data: Path
    """The trajectory aggregate (.jsonl), one record per task (format: ``grpo``)."""
    init_checkpoint: Path
    """Hugging Face directory the policy starts from; also the 'old' policy of the ratio."""
    reference_checkpoint: Path | None
    """Hugging Face directory of the KL reference, or None for no KL term."""
    output: Path
    """Staging directory for the new checkpoint (rank 0 writes it)."""
    seed: int
    """Seeds torch and the per-epoch shuffle (same on every rank)."""
    lr: LearningRate
    """AdamW learning rate (no weight decay, no schedule: one update per iteration)."""
    epochs: Epochs
    """Passes over the aggregate."""
    micro_batch: MicroBatch
    """Records (whole groups) per optimizer step, over all workers (train/plan.py)."""
    clip_eps: ClipEps
    """PPO clip range of the ratio."""
    kl_coef: KLCoef
    """Weight of the k3 KL term; 0 turns it off."""
    max_grad_norm: MaxGradNorm
    """Gradient-norm clip."""
    init_iteration: int | None = None
    """The iteration whose update ``init_checkpoint`` holds (None: the base model). A serving
    trainer that made that update continues from memory instead of loading it."""
    micro_batch_tokens: MicroBatchTokens = 0
    """A worker's micro-batches, which it accumulates gradients over, hold at most this many
    tokens, padding included (0: a worker's part of a step is one micro-batch)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the workers share the model (train/parallel.py)."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False
    parallel_write: bool = True
    """With fsdp: every worker writes its shard of the checkpoint (false: worker 0 writes it all)."""
    offload: bool = False
    """After the update, move the model and optimizer state to host memory (and back at the
    next request), so that engines sharing the GPU have its memory while they run."""

    @property
    def uses_kl(self) -> bool:
        return self.kl_coef > 0 and self.reference_checkpoint is not None

    @classmethod
    def from_json(cls, raw: object) -> "TrainConfig":
        """Raises ValueError naming the key at fault."""
        if not isinstance(raw, dict):
            raise ValueError("the train config is not a JSON object")
        names = [f.name for f in fields(cls)]
        missing = [f.name for f in fields(cls) if f.name not in raw and f.default is MISSING]
        if missing:
            raise ValueError(f"the train config lacks {', '.join(missing)}")
        unknown = sorted(set(raw) - set(names))
        if unknown:
            log.warning("ignoring unknown train config keys: %s", ", ".join(unknown))
        try:
            return msgspec.convert(raw, cls, dec_hook=_absolute_path)
        except msgspec.ValidationError as e:
            where = re.fullmatch(r"(.*) - at `\$\.(\w+)`", str(e), re.S)
            if where is None or where[2] not in raw:
                raise ValueError(f"the train config: {e}") from None
            raise ValueError(f"train config key {where[2]!r} is {raw[where[2]]!r}: {where[1]}") from None

    @classmethod
    def read(cls, path: Path) -> "TrainConfig":
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            return cls.from_json(raw)
        except (OSError, ValueError) as e:
            raise BadTrainInput(f"train config {path}: {e}") from None


def _absolute_path(type_: type, value: object) -> Path:
    """msgspec's decoder of the ``Path`` fields: absolute paths only."""
    if type_ is not Path:
        raise NotImplementedError(type_)
    if not isinstance(value, str):
        raise TypeError(f"Expected `str`, got `{type(value).__name__}`")
    if not Path(value).is_absolute():
        raise ValueError("must be an absolute path")
    return Path(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    addr: str
    port: int
    world_size: int
    rank: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    local_rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"TRAIN_BACKEND must be gloo or nccl, got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"MASTER_PORT={self.port} is not a port")
        if not self.timeout_s > 0:
            raise ValueError(f"TRAIN_TIMEOUT_S must be > 0, got {self.timeout_s}")

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"tcp://{host}:{self.port}"

    @classmethod
    def from_env(cls, env) -> "Rendezvous":
        """Raises BadTrainInput naming the variable at fault."""
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if not env.get(v)]
        if missing:
            raise BadTrainInput(f"environment lacks {', '.join(missing)} (set by the orchestrator's launch)")
        backend = env.get("TRAIN_BACKEND") or _default_backend()
        try:
            return cls(
                addr=env["MASTER_ADDR"],
                port=int(env["MASTER_PORT"]),
                world_size=int(env["WORLD_SIZE"]),
                rank=int(env["RANK"]),
                backend=backend,
                timeout_s=float(env.get("TRAIN_TIMEOUT_S") or DEFAULT_TIMEOUT_S),
                local_rank=int(env.get("LOCAL_RANK") or 0),
            )
        except ValueError as e:
            raise BadTrainInput(f"bad rendezvous environment: {e}") from None


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


# --- the process group ---------------------------------------------------------------------


def join(rdv: Rendezvous):
    """Form the process group; returns this rank's device. Raises RendezvousFailed."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if rdv.backend == "nccl":
        device = torch.device("cuda", rdv.local_rank)
        torch.cuda.set_device(device)
    started = time.monotonic()
    log.info("joining rendezvous %s as rank %d of %d (%s, timeout %.0fs)", rdv.url, rdv.rank, rdv.world_size, rdv.backend, rdv.timeout_s)
    try:
        dist.init_process_group(
            rdv.backend,
            init_method=rdv.url,
            world_size=rdv.world_size,
            rank=rdv.rank,
            timeout=timedelta(seconds=rdv.timeout_s),
            device_id=device if rdv.backend == "nccl" else None,
        )
    except Exception as e:  # torch raises DistStoreError, DistNetworkError, RuntimeError, ...
        raise RendezvousFailed(
            f"rendezvous at {rdv.url} (world size {rdv.world_size}) failed after {time.monotonic() - started:.1f}s: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. Check that every trainer rank was launched, that rank 0's host "
            f"resolves and its port is reachable from this node."
        ) from None
    log.info("process group formed in %.1fs", time.monotonic() - started)
    return device


# --- training ------------------------------------------------------------------------------


def _load_model(path: Path, device, setup: "Setup", world_size: int):
    """The Hugging Face model at ``path``, prepared for ``setup``'s strategy (parallel.py)."""
    from transformers import AutoModelForCausalLM

    # Eval mode throughout: no dropout, so the first step's ratio is exactly what the
    # precomputed old log-probs say it is. Gradients (and their reduction) do not depend on it.
    model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).eval()
    if not setup.sharded:
        model.to(device)  # FSDP moves each block to the device as it shards it: one whole block on the GPU at a time
    try:
        return parallel.prepare(model, strategy=setup.strategy, device=device, world_size=world_size,
                                mixed_precision=setup.mixed_precision, activation_checkpointing=setup.activation_checkpointing)
    except ValueError as e:
        raise BadTrainInput(f"{path}: {e}") from None


@dataclass(frozen=True, slots=True)
class Setup:
    """What a model in memory was prepared for; another setup loads it again."""

    strategy: str
    mixed_precision: str
    activation_checkpointing: bool

    @classmethod
    def of(cls, config: TrainConfig) -> "Setup":
        return cls(config.strategy, config.mixed_precision, config.activation_checkpointing)

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"


def _read_records(path: Path) -> list[grpo.Record]:
    try:
        records = grpo.read_records(path)
    except (OSError, ValueError) as e:
        raise BadTrainInput(f"trajectory aggregate: {e}") from None
    if not records:
        raise BadTrainInput(f"trajectory aggregate {path} holds no records")
    return records


def _check_vocabulary(records: list[grpo.Record], vocab: int, model: Path) -> None:
    """Every rank checks every record, so a bad one fails them all alike (none waits in a collective)."""
    for r in records:
        if r.prompt_token_ids is None:
            continue
        if max(max(r.prompt_token_ids), *(max(s.token_ids, default=0) for s in r.samples)) >= vocab:
            raise BadTrainInput(f"trajectory record {r.task_id} holds a token id past the model's vocabulary of {vocab}: "
                                f"it was sampled from another model than {model}")


def _all_equal(record: grpo.Record) -> bool:
    rewards = [s.reward for s in record.samples]
    return max(rewards) == min(rewards)


@dataclass(slots=True)
class _Batches:
    """The iteration's samples as token ids, and the log-probs of this worker's samples under
    the init policy and the reference, by (record, sample)."""

    completions: list[list[grpo.Completion]]
    pad_id: int
    old: dict = field(default_factory=dict)
    ref: dict | None = None

    def collate(self, keys: list[plan.Key], device) -> grpo.Batch:
        """The batch of these samples; an empty pass is sample (0, 0), weighed by zero."""
        return grpo.collate([self.completions[k][s] for k, s in keys or [(0, 0)]], self.pad_id).to(device)

    def lined_up(self, keys: list[plan.Key], which: dict):
        import torch

        return torch.cat([which[key] for key in keys])


class Trainer:
    """One train worker's model, optimizer, tokenizer and KL reference, inside a formed
    process group; ``update`` makes one iteration's GRPO update. Kept across updates by
    ``--serve``; a one-shot run makes a single update."""

    def __init__(self, rdv: Rendezvous, device):
        self.rdv = rdv
        self.device = device
        self.model = None
        self.optimizer = None
        self.tokenizer = None
        self.setup: Setup | None = None
        self.pad_id = 0
        self.holds: int | None = None  # the iteration whose update the model holds (None: loaded, or nothing)
        self.continued_from: int | None = None
        self.reference = None  # (path, model)
        self.offloaded = False

    # -- the policy in memory ------------------------------------------------------------------

    def _policy(self, config: TrainConfig) -> str:
        """Make the model and optimizer those of ``config.init_checkpoint``; returns how."""
        import torch

        setup = Setup.of(config)
        if self.model is not None and self.holds is not None and config.init_iteration == self.holds and setup == self.setup:
            self._onload()
            self.continued_from = int(max((s["step"].item() for s in self.optimizer.state.values()), default=0)) or None
            return "memory"
        from transformers import AutoTokenizer

        self.model = self.optimizer = None
        self.tokenizer = AutoTokenizer.from_pretrained(config.init_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.model = _load_model(config.init_checkpoint, self.device, setup, self.rdv.world_size)
        self.setup = setup
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        try:
            self.continued_from = optimizer_state.load(self.optimizer, self.model, config.init_checkpoint)
        except ValueError as e:
            raise BadTrainInput(str(e)) from None
        self.offloaded = False
        return "checkpoint"

    def _reference(self, config: TrainConfig):
        """The KL reference model, loaded once per path, sharded as the policy is (no gradients,
        no optimizer, no activation checkpointing)."""
        if self.reference is None or self.reference[0] != (config.reference_checkpoint, self.setup):
            setup = Setup(self.setup.strategy, self.setup.mixed_precision, False)
            model = _load_model(config.reference_checkpoint, self.device, setup, self.rdv.world_size)
            model.requires_grad_(False)
            self.reference = ((config.reference_checkpoint, self.setup), model)
        return self.reference[1]

    def _move(self, device) -> None:
        for p in self.model.parameters():
            p.data = p.data.to(device)
            p.grad = None
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step":
                    state[key] = value.to(device)

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory; the GPU's cache freed."""
        import torch

        if self.device.type != "cuda" or self.offloaded:
            return
        if self.setup.sharded:
            log.warning("train.strategy=fsdp keeps its shards on the GPU between updates (offload is for ddp)")
            return
        self._move(torch.device("cpu"))
        if self.reference is not None:
            self.reference = None  # reloaded next time: keeping it would hold the GPU
        torch.cuda.empty_cache()
        self.offloaded = True

    def _onload(self) -> None:
        if self.offloaded:
            self._move(self.device)
            self.offloaded = False

    # -- one update ----------------------------------------------------------------------------

    def update(self, config: TrainConfig, started: float) -> tuple[dict, dict, dict]:
        """The GRPO update (train/plan.py says how it is cut up); the checkpoint written (by
        worker 0, or by every worker's shard with FSDP). Returns (stats, seconds per part,
        memory); the stats are complete on worker 0. ``started``: when this update began
        (monotonic)."""
        import torch
        import torch.distributed as dist

        rdv, device = self.rdv, self.device
        timing: dict[str, float] = {}
        mark = time.monotonic()

        def lap(part: str) -> None:
            nonlocal mark
            now = time.monotonic()
            timing[part] = round(timing.get(part, 0.0) + now - mark, 4)
            mark = now

        records = _read_records(config.data)
        source = self._policy(config)
        torch.manual_seed(config.seed)  # after loading, which may draw from it: memory and checkpoint alike
        self.holds = None  # from here until the update is complete, memory holds no known iteration
        for group in self.optimizer.param_groups:
            group["lr"] = config.lr
        lap("load")
        batches, lengths = self._prepare(config, records)
        steps = plan.update_plan(lengths, world_size=rdv.world_size, rank=rdv.rank, batch_records=config.micro_batch,
                                 budget=config.micro_batch_tokens, seed=config.seed, epochs=config.epochs)
        lap("prepare")

        sync = parallel.Sync(self.model, strategy=config.strategy, device=device)
        autocast = parallel.autocast(device, strategy=config.strategy, mixed_precision=config.mixed_precision)
        log.info("rank %d: %s (%s)", rdv.rank, "a fresh optimizer" if self.continued_from is None else
                 f"optimizer continued from step {self.continued_from}", "in memory" if source == "memory" else f"loaded from {config.init_checkpoint}")
        log.info("rank %d: %d records, %d epochs x %d steps of %d records; %s, %s%s", rdv.rank, len(records), config.epochs, len(steps[0]),
                 config.micro_batch, config.strategy, config.mixed_precision, ", activation checkpointing" if config.activation_checkpointing else "")

        per_step: dict[str, list] = {"loss": [], "kl": [], "clip_fraction": [], "grad_norm": [], "tokens": [], "micro_batches": []}
        memory: dict = {}
        for epoch, epoch_steps in enumerate(steps):
            for number, step in enumerate(epoch_steps):
                self.optimizer.zero_grad(set_to_none=True)
                # This worker's sums over its tokens: loss, k3, clipped tokens, tokens.
                sums = torch.zeros(4, dtype=torch.float64, device=device)
                normalizer = max(step.tokens, 1) / rdv.world_size
                for slot, keys in enumerate(step.micro_batches):
                    with sync.micro_batch(last=slot == len(step.micro_batches) - 1):
                        batch = batches.collate(keys, device)
                        with autocast:
                            new_lp = grpo.completion_logprobs(sync.module, batch)
                        old_lp = batches.lined_up(keys, batches.old) if keys else new_lp.detach()
                        ref_lp = (batches.lined_up(keys, batches.ref) if keys else new_lp.detach()) if batches.ref is not None else None
                        parts = grpo.grpo_loss(new_lp, old_lp, batch.advantages, clip_eps=config.clip_eps, kl_coef=config.kl_coef,
                                               ref_logprobs=ref_lp, normalizer=normalizer)
                        (parts.loss if keys else parts.loss * 0.0).backward()
                    if keys:
                        sums += torch.tensor([parts.loss.item() * normalizer, (parts.kl or 0.0) * parts.tokens,
                                              parts.clip_fraction * parts.tokens, parts.tokens], dtype=torch.float64, device=device)
                grad_norm = sync.clip_grad_norm(config.max_grad_norm)
                self.optimizer.step()
                if not memory and epoch == len(steps) - 1 and number == len(epoch_steps) - 1:
                    memory = parallel.storage_bytes(self.model, self.optimizer)

                dist.all_reduce(sums)
                total = max(sums[3].item(), 1.0)
                loss, kl, clip_fraction = (x / total for x in sums[:3].tolist())
                tokens = int(sums[3].item())
                for key, value in zip(per_step, (loss, kl if config.uses_kl else None, clip_fraction, grad_norm, tokens, len(step.micro_batches))):
                    per_step[key].append(value)
                if rdv.rank == 0:
                    log.info(
                        "iteration %d epoch %d step %d/%d: loss %.5f%s clip %.3f grad_norm %.3f tokens %d in %d micro-batches",
                        config.iteration, epoch, number + 1, len(epoch_steps), loss, f" kl {kl:.5f}" if config.uses_kl else "", clip_fraction,
                        grad_norm, tokens, len(step.micro_batches),
                    )
        self.optimizer.zero_grad(set_to_none=True)
        del sync
        lap("steps")

        samples = [s for r in records for s in r.samples]
        stats = {
            "iteration": config.iteration,
            "world_size": rdv.world_size,
            "strategy": config.strategy,
            "mixed_precision": config.mixed_precision,
            "activation_checkpointing": config.activation_checkpointing,
            "records": len(records),
            "samples": len(samples),
            "completion_tokens": sum(map(sum, lengths.completions)),
            "mean_reward": sum(s.reward for s in samples) / len(samples),
            "zero_advantage_groups": sum(1 for r in records if _all_equal(r)),
            "records_tokenized_from_text": sum(1 for r in records if r.prompt_token_ids is None),
            "epochs": config.epochs,
            "steps_per_epoch": len(steps[0]),
            "micro_batch": config.micro_batch,
            "micro_batch_tokens": config.micro_batch_tokens,
            "optimizer_continued_from_step": self.continued_from,
            "policy_from": source,
            **per_step,
            "seconds": None,  # set just before writing
        }
        self._write_checkpoint(config, stats, started)
        lap("checkpoint")
        self.holds = config.iteration
        if config.offload:
            self.offload()
            lap("offload")
        memory["peak_rss_bytes"] = _peak_rss_bytes()
        return stats, timing, memory

    def _prepare(self, config: TrainConfig, records: list[grpo.Record]) -> tuple[_Batches, plan.Lengths]:
        """Every record encoded (every worker plans every worker's part), and the log-probs of
        this worker's under the init policy and the reference."""
        rdv, model = self.rdv, self.model
        vocab = model.get_input_embeddings().num_embeddings
        _check_vocabulary(records, vocab, config.init_checkpoint)
        completions = [grpo.encode_record(self.tokenizer, r) for r in records]
        lengths = plan.Lengths(rows=[[len(c.prompt_ids) + len(c.completion_ids) for c in group] for group in completions],
                               completions=[[len(c.completion_ids) for c in group] for group in completions])
        batches = _Batches(completions, self.pad_id)
        passes = plan.logprob_plan(lengths, world_size=rdv.world_size, rank=rdv.rank, budget=config.micro_batch_tokens)
        batches.old = self._logprobs(model, batches, passes, config)
        if config.uses_kl:
            if config.reference_checkpoint.resolve() == config.init_checkpoint.resolve():
                batches.ref = batches.old
            else:
                batches.ref = self._logprobs(self._reference(config), batches, passes, config)
        elif config.kl_coef > 0:
            log.warning("kl_coef is %g but there is no reference checkpoint: no KL term", config.kl_coef)
        return batches, lengths

    def _logprobs(self, model, batches: _Batches, passes: list[list[plan.Key]], config: TrainConfig) -> dict:
        """Per sample, its completion tokens' log-probs under ``model`` (no grad); every worker
        runs as many passes (FSDP gathers parameters collectively at each)."""
        import torch

        out = {}
        autocast = parallel.autocast(self.device, strategy=config.strategy, mixed_precision=config.mixed_precision)
        with torch.no_grad():
            for keys in passes:
                with autocast:
                    lp = grpo.completion_logprobs(model, batches.collate(keys, self.device))
                sizes = [len(batches.completions[k][s].completion_ids) for k, s in keys]
                out.update(zip(keys, lp.split(sizes) if keys else ()))
        return out

    def _write_checkpoint(self, config: TrainConfig, stats: dict, started: float) -> None:
        """Worker 0 writes the whole checkpoint (ddp), or every worker its shards (fsdp); then
        every worker passes the final barrier. ``train_stats.json`` comes last, from worker 0."""
        rank, output, device = self.rdv.rank, config.output, self.device
        if rank == 0:
            output.mkdir(parents=True, exist_ok=True)
            # A stats file left by an earlier attempt would vouch for weights being rewritten now.
            (output / STATS_FILE).unlink(missing_ok=True)
        if self.setup.sharded:
            def barrier() -> None:
                _barrier(device, "checkpoint shard")

            barrier()  # worker 0 made the directory
            sharded.save_model(self.model, output, rank=rank, world_size=self.rdv.world_size, barrier=barrier, parallel=config.parallel_write)
            optimizer_state.save_sharded(self.optimizer, self.model, output, rank=rank, world_size=self.rdv.world_size, barrier=barrier,
                                         parallel=config.parallel_write)
            if rank == 0:
                self.model.config.save_pretrained(output)
                if self.model.can_generate() and self.model.generation_config is not None:
                    self.model.generation_config.save_pretrained(output)
        elif rank == 0:
            self.model.save_pretrained(output)
            optimizer_state.save(self.optimizer, self.model, output)
        if rank == 0:
            self.tokenizer.save_pretrained(output)
            stats["seconds"] = round(time.monotonic() - started, 3)
            fsio.atomic_write_bytes(output / STATS_FILE, json.dumps(stats, indent=1).encode())
            log.info("wrote checkpoint to %s (%.1fs)", output, stats["seconds"])
        _barrier(device)


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _barrier(device, what: str = "final barrier") -> None:
    """Every rank has its part of the update done, and rank 0 its checkpoint written; a rank 0
    that dies on the way makes this fail."""
    import torch.distributed as dist

    try:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
    except Exception as e:
        raise TrainerError(f"{what} failed (a peer died or timed out): {type(e).__name__}: {e}") from None


# --- entry points --------------------------------------------------------------------------


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _startup_seconds() -> float:
    """Since this process was created (its interpreter start and imports included)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def _answer(done: Path, config: TrainConfig, stats: dict, timing: dict, memory: dict) -> None:
    fsio.write_record(done, {"iteration": config.iteration, "pid": os.getpid(), "timing": timing, "memory": memory, "stats": stats}, durable=False)


def run(config_path: Path, env, done: Path | None = None) -> None:
    """Join, make one update (rank 0 writes), and pass the final barrier; then write ``done``
    if given. Raises TrainerError."""
    rdv = Rendezvous.from_env(env)
    config = TrainConfig.read(config_path)
    device = join(rdv)
    _quiet_transformers()
    startup = round(_startup_seconds(), 4)
    stats, timing, memory = Trainer(rdv, device).update(config, time.monotonic())
    if done is not None:
        _answer(done, config, stats, {"startup": startup, **timing}, memory)
    # No destroy_process_group(): rank 0 hosts the TCPStore, and when it tears down and exits
    # while a peer is still inside its own teardown, the peer's store thread aborts the process
    # ("terminate called without an active exception", exit -6). Everything durable is
    # written before the barrier, so the process simply ends (see __main__).


def _request(line: str) -> tuple[Path, Path]:
    try:
        request = json.loads(line)
        return Path(request["config"]), Path(request["done"])
    except (ValueError, KeyError, TypeError) as e:
        raise BadTrainInput(f"a request on stdin is not {{\"config\": PATH, \"done\": PATH}}: {line[:200]!r} ({e})") from None


def serve(env, requests) -> None:
    """Join once, then one update per request line until ``requests`` ends. Raises TrainerError."""
    rdv = Rendezvous.from_env(env)
    device = join(rdv)
    _quiet_transformers()
    trainer = Trainer(rdv, device)
    startup = round(_startup_seconds(), 4)
    for line in requests:
        if not line.strip():
            continue
        started = time.monotonic()
        config_path, done = _request(line)
        config = TrainConfig.read(config_path)
        log.info("pid %d: update of iteration %d", os.getpid(), config.iteration)
        stats, timing, memory = trainer.update(config, started)
        if startup is not None:
            timing = {"startup": startup, **timing}
            startup = None
        _answer(done, config, stats, timing, memory)
    log.info("stdin ended: no more updates")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.train.worker", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train-config", type=Path, help="the train config JSON written by the orchestrator: one update")
    mode.add_argument("--serve", action="store_true", help="one update per request line on stdin, until it ends")
    parser.add_argument("--done", type=Path, help="with --train-config: where to write the answer (iteration, pid, stats, timing)")
    args = parser.parse_args(argv)
    who = f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s trainer {who} %(levelname)s %(name)s: %(message)s", force=True)
    try:
        if args.serve:
            serve(os.environ, sys.stdin)
        else:
            run(args.train_config, os.environ, args.done)
    except TrainerError as e:
        log.error("trainer %s failed: %s", who, e)
        child_error.write(e, program="trainer", exit_code=e.exit_code)
        return e.exit_code
    except Exception as e:
        log.exception("trainer %s failed: %s: %s", who, type(e).__name__, e)
        child_error.write(e, program="trainer", exit_code=EXIT_ERROR)
        return EXIT_ERROR
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: c10d's C++ threads must not be destroyed under a live group.
    os._exit(code)
