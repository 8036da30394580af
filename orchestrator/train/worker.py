"""The trainer process, one per train worker, launched by the orchestrator:

    python -m orchestrator.train.worker --train-config PATH [--done PATH]   one update, then exit
    python -m orchestrator.train.worker --serve                 one update per request, until stdin ends

The processes form a torch.distributed group over a TCP rendezvous (never ``file://``: see
SHARED-FS.md), run a GRPO update of the init checkpoint with DDP, and rank 0 writes the new
checkpoint.

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

What rank 0 writes into ``output``: ``config.json``, ``generation_config.json``,
``model.safetensors``, the tokenizer files, ``optimizer/adamw.safetensors``, and last
``train_stats.json`` (temp + rename, after everything else), so ``train_stats.json``
vouches for the rest.

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
from dataclasses import MISSING, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Annotated

import msgspec

from orchestrator.config import ClipEps, Epochs, KLCoef, LearningRate, MaxGradNorm, MicroBatch
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_OK
from orchestrator.protocol import child_error, fsio
from orchestrator.train import grpo, optimizer_state

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
    """Records (whole groups) per optimizer step per rank."""
    clip_eps: ClipEps
    """PPO clip range of the ratio."""
    kl_coef: KLCoef
    """Weight of the k3 KL term; 0 turns it off."""
    max_grad_norm: MaxGradNorm
    """Gradient-norm clip."""
    init_iteration: int | None = None
    """The iteration whose update ``init_checkpoint`` holds (None: the base model). A serving
    trainer that made that update continues from memory instead of loading it."""
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


@dataclass(slots=True)
class _Shard:
    """What this rank trains on: its micro-batches per epoch, the encoded records they use, and
    those records' per-token log-probs under the init policy and the reference."""

    batches: list[list[list[int]]]  # [epoch][step] -> record indices
    completions: dict[int, list[grpo.Completion]]
    old_logprobs: dict[int, "torch.Tensor"]  # noqa: F821
    ref_logprobs: dict[int, "torch.Tensor"] | None  # noqa: F821

    def micro_batch(self, keys: list[int], pad_id: int, device):
        """The batch of these records' samples, with its old and reference log-probs lined up."""
        import torch

        batch = grpo.collate([c for k in keys for c in self.completions[k]], pad_id).to(device)
        old = torch.cat([self.old_logprobs[k] for k in keys])
        ref = torch.cat([self.ref_logprobs[k] for k in keys]) if self.ref_logprobs is not None else None
        return batch, old, ref


def _load_model(path: Path, device):
    from transformers import AutoModelForCausalLM

    # Eval mode throughout: no dropout, so the first step's ratio is exactly what the
    # precomputed old log-probs say it is. Gradients (and DDP's reduction) do not depend on it.
    return AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).to(device).eval()


def _record_logprobs(model, completions: dict[int, list[grpo.Completion]], pad_id: int, device) -> dict:
    """Per record, the flat completion-token log-probs under ``model`` (no grad)."""
    import torch

    with torch.no_grad():
        return {k: grpo.completion_logprobs(model, grpo.collate(group, pad_id).to(device)) for k, group in completions.items()}


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
        self.pad_id = 0
        self.holds: int | None = None  # the iteration whose update the model holds (None: loaded, or nothing)
        self.continued_from: int | None = None
        self.reference = None  # (path, model)
        self.offloaded = False

    # -- the policy in memory ------------------------------------------------------------------

    def _policy(self, config: TrainConfig) -> str:
        """Make the model and optimizer those of ``config.init_checkpoint``; returns how."""
        import torch

        if self.model is not None and self.holds is not None and config.init_iteration == self.holds:
            self._onload()
            self.continued_from = int(max((s["step"].item() for s in self.optimizer.state.values()), default=0)) or None
            return "memory"
        from transformers import AutoTokenizer

        self.model = self.optimizer = None
        self.tokenizer = AutoTokenizer.from_pretrained(config.init_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.model = _load_model(config.init_checkpoint, self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        try:
            self.continued_from = optimizer_state.load(self.optimizer, self.model, config.init_checkpoint)
        except ValueError as e:
            raise BadTrainInput(str(e)) from None
        self.offloaded = False
        return "checkpoint"

    def _reference(self, config: TrainConfig):
        """The KL reference model, loaded once per path."""
        if self.reference is None or self.reference[0] != config.reference_checkpoint:
            self.reference = (config.reference_checkpoint, _load_model(config.reference_checkpoint, self.device))
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

    def update(self, config: TrainConfig, started: float) -> tuple[dict, dict]:
        """The GRPO update; rank 0 writes the checkpoint. Returns (stats, seconds per part);
        the stats are complete on rank 0. ``started``: when this update began (monotonic)."""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

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
        shard = self._prepare_shard(config, records)
        lap("prepare")

        # The aggregate's token count: every rank counts its own (disjoint) part, which its
        # micro-batches always cover, then one all_reduce.
        own = grpo.shard(len(records), rdv.world_size, rdv.rank)
        total_tokens = torch.tensor([sum(len(c.completion_ids) for k in own for c in shard.completions[k])], dtype=torch.float64, device=device)
        dist.all_reduce(total_tokens)

        # Built for each update (it broadcasts rank 0's parameters: every rank starts equal).
        ddp = DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        log.info("rank %d: %s (%s)", rdv.rank, "a fresh optimizer" if self.continued_from is None else
                 f"optimizer continued from step {self.continued_from}", "in memory" if source == "memory" else f"loaded from {config.init_checkpoint}")
        steps = len(shard.batches[0])
        log.info("rank %d: %d of %d records, %d epochs x %d steps of %d records", rdv.rank, len(own), len(records), config.epochs, steps, config.micro_batch)

        per_step: dict[str, list] = {"loss": [], "kl": [], "clip_fraction": [], "grad_norm": [], "tokens": []}
        for epoch, micro_batches in enumerate(shard.batches):
            for step, keys in enumerate(micro_batches):
                batch, old_lp, ref_lp = shard.micro_batch(keys, self.pad_id, device)
                new_lp = grpo.completion_logprobs(ddp, batch)
                parts = grpo.grpo_loss(new_lp, old_lp, batch.advantages, clip_eps=config.clip_eps, kl_coef=config.kl_coef, ref_logprobs=ref_lp)
                self.optimizer.zero_grad(set_to_none=True)
                parts.loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.max_grad_norm).item()
                self.optimizer.step()

                # Means over ranks of the loss (what DDP's averaged gradient follows), kl and
                # clip fraction; the token count is a sum.
                summary = torch.tensor([parts.loss.item(), parts.kl or 0.0, parts.clip_fraction, parts.tokens], dtype=torch.float64, device=device)
                dist.all_reduce(summary)
                loss, kl, clip_fraction = (x / rdv.world_size for x in summary[:3].tolist())
                tokens = int(summary[3].item())
                for key, value in zip(per_step, (loss, kl if config.uses_kl else None, clip_fraction, grad_norm, tokens)):
                    per_step[key].append(value)
                if rdv.rank == 0:
                    log.info(
                        "iteration %d epoch %d step %d/%d: loss %.5f%s clip %.3f grad_norm %.3f tokens %d",
                        config.iteration, epoch, step + 1, steps, loss, f" kl {kl:.5f}" if config.uses_kl else "", clip_fraction, grad_norm, tokens,
                    )
        self.optimizer.zero_grad(set_to_none=True)
        del ddp
        lap("steps")

        samples = [s for r in records for s in r.samples]
        stats = {
            "iteration": config.iteration,
            "world_size": rdv.world_size,
            "records": len(records),
            "samples": len(samples),
            "completion_tokens": int(total_tokens.item()),
            "mean_reward": sum(s.reward for s in samples) / len(samples),
            "zero_advantage_groups": sum(1 for r in records if _all_equal(r)),
            "records_tokenized_from_text": sum(1 for r in records if r.prompt_token_ids is None),
            "epochs": config.epochs,
            "steps_per_epoch": steps,
            "micro_batch": config.micro_batch,
            "optimizer_continued_from_step": self.continued_from,
            "policy_from": source,
            **per_step,
            "seconds": None,  # set just before writing
        }
        if rdv.rank == 0:
            _write_checkpoint(self.model, self.tokenizer, self.optimizer, config.output, stats, started)
        _barrier(device)
        lap("checkpoint")
        self.holds = config.iteration
        if config.offload:
            self.offload()
            lap("offload")
        return stats, timing

    def _prepare_shard(self, config: TrainConfig, records: list[grpo.Record]) -> _Shard:
        rdv, model, pad_id, device = self.rdv, self.model, self.pad_id, self.device
        n = len(records)
        batches = [grpo.epoch_batches(n, rdv.world_size, rdv.rank, config.micro_batch, seed=config.seed, epoch=e) for e in range(config.epochs)]
        needed = sorted({k for epoch in batches for keys in epoch for k in keys})
        _check_vocabulary(records, model.get_input_embeddings().num_embeddings, config.init_checkpoint)
        completions = {k: grpo.encode_record(self.tokenizer, records[k]) for k in needed}
        old = _record_logprobs(model, completions, pad_id, device)
        ref = None
        if config.uses_kl:
            if config.reference_checkpoint.resolve() == config.init_checkpoint.resolve():
                ref = old
            else:
                ref = _record_logprobs(self._reference(config), completions, pad_id, device)
        elif config.kl_coef > 0:
            log.warning("kl_coef is %g but there is no reference checkpoint: no KL term", config.kl_coef)
        return _Shard(batches, completions, old, ref)


def _barrier(device) -> None:
    """Every rank has its part of the update done, and rank 0 its checkpoint written; a rank 0
    that dies on the way makes this fail."""
    import torch.distributed as dist

    try:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
    except Exception as e:
        raise TrainerError(f"final barrier failed (a peer died or timed out): {type(e).__name__}: {e}") from None


def _write_checkpoint(model, tokenizer, optimizer, output: Path, stats: dict, started: float) -> None:
    output.mkdir(parents=True, exist_ok=True)
    # A stats file left by an earlier attempt would vouch for weights being rewritten now.
    (output / STATS_FILE).unlink(missing_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    optimizer_state.save(optimizer, model, output)
    stats["seconds"] = round(time.monotonic() - started, 3)
    fsio.atomic_write_bytes(output / STATS_FILE, json.dumps(stats, indent=1).encode())
    log.info("wrote checkpoint to %s (%.1fs)", output, stats["seconds"])


# --- entry points --------------------------------------------------------------------------


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _startup_seconds() -> float:
    """Since this process was created (its interpreter start and imports included)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def _answer(done: Path, config: TrainConfig, stats: dict, timing: dict) -> None:
    fsio.write_record(done, {"iteration": config.iteration, "pid": os.getpid(), "timing": timing, "stats": stats}, durable=False)


def run(config_path: Path, env, done: Path | None = None) -> None:
    """Join, make one update (rank 0 writes), and pass the final barrier; then write ``done``
    if given. Raises TrainerError."""
    rdv = Rendezvous.from_env(env)
    config = TrainConfig.read(config_path)
    device = join(rdv)
    _quiet_transformers()
    startup = round(_startup_seconds(), 4)
    stats, timing = Trainer(rdv, device).update(config, time.monotonic())
    if done is not None:
        _answer(done, config, stats, {"startup": startup, **timing})
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
        stats, timing = trainer.update(config, started)
        if startup is not None:
            timing = {"startup": startup, **timing}
            startup = None
        _answer(done, config, stats, timing)
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
