"""The trainer process: ``python -m orchestrator.train.worker --train-config PATH``.

One process per node, launched by the orchestrator. The processes form a torch.distributed
group over a TCP rendezvous (never ``file://``: see SHARED-FS.md), run a GRPO update of the
init checkpoint with DDP, and rank 0 writes the new checkpoint.

Train config (JSON, written by the orchestrator; every key is required, unknown keys are
logged and ignored): see ``TrainConfig``.

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
from dataclasses import dataclass, fields
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

    @property
    def uses_kl(self) -> bool:
        return self.kl_coef > 0 and self.reference_checkpoint is not None

    @classmethod
    def from_json(cls, raw: object) -> "TrainConfig":
        """Raises ValueError naming the key at fault."""
        if not isinstance(raw, dict):
            raise ValueError("the train config is not a JSON object")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in raw]
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


def _prepare_shard(config: TrainConfig, rdv: Rendezvous, records: list[grpo.Record], tokenizer, model, pad_id: int, device) -> _Shard:
    n = len(records)
    batches = [grpo.epoch_batches(n, rdv.world_size, rdv.rank, config.micro_batch, seed=config.seed, epoch=e) for e in range(config.epochs)]
    needed = sorted({k for epoch in batches for keys in epoch for k in keys})
    _check_vocabulary(records, model.get_input_embeddings().num_embeddings, config.init_checkpoint)
    completions = {k: grpo.encode_record(tokenizer, records[k]) for k in needed}
    old = _record_logprobs(model, completions, pad_id, device)
    ref = None
    if config.uses_kl:
        if config.reference_checkpoint.resolve() == config.init_checkpoint.resolve():
            ref = old
        else:
            reference = _load_model(config.reference_checkpoint, device)
            ref = _record_logprobs(reference, completions, pad_id, device)
            del reference
    elif config.kl_coef > 0:
        log.warning("kl_coef is %g but there is no reference checkpoint: no KL term", config.kl_coef)
    return _Shard(batches, completions, old, ref)


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


def train(config: TrainConfig, rdv: Rendezvous, device, started: float) -> dict:
    """The GRPO update inside a formed process group; rank 0 writes the checkpoint.

    Returns the stats (complete on rank 0). ``started`` is when ``run`` began (monotonic
    clock), for the stats' ``seconds``.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.manual_seed(config.seed)

    records = _read_records(config.data)
    tokenizer = AutoTokenizer.from_pretrained(config.init_checkpoint)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = _load_model(config.init_checkpoint, device)
    shard = _prepare_shard(config, rdv, records, tokenizer, model, pad_id, device)

    # The aggregate's token count: every rank counts its own (disjoint) part, which its
    # micro-batches always cover, then one all_reduce.
    own = grpo.shard(len(records), rdv.world_size, rdv.rank)
    total_tokens = torch.tensor([sum(len(c.completion_ids) for k in own for c in shard.completions[k])], dtype=torch.float64, device=device)
    dist.all_reduce(total_tokens)

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=config.lr, weight_decay=0.0)
    try:
        continued_from = optimizer_state.load(optimizer, model, config.init_checkpoint)
    except ValueError as e:
        raise BadTrainInput(str(e)) from None
    log.info("rank %d: %s", rdv.rank, "a fresh optimizer" if continued_from is None else f"optimizer continued from step {continued_from}")
    steps = len(shard.batches[0])
    log.info("rank %d: %d of %d records, %d epochs x %d steps of %d records", rdv.rank, len(own), len(records), config.epochs, steps, config.micro_batch)

    per_step: dict[str, list] = {"loss": [], "kl": [], "clip_fraction": [], "grad_norm": [], "tokens": []}
    for epoch, micro_batches in enumerate(shard.batches):
        for step, keys in enumerate(micro_batches):
            batch, old_lp, ref_lp = shard.micro_batch(keys, pad_id, device)
            new_lp = grpo.completion_logprobs(ddp, batch)
            parts = grpo.grpo_loss(new_lp, old_lp, batch.advantages, clip_eps=config.clip_eps, kl_coef=config.kl_coef, ref_logprobs=ref_lp)
            optimizer.zero_grad(set_to_none=True)
            parts.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.max_grad_norm).item()
            optimizer.step()

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
        "optimizer_continued_from_step": continued_from,
        **per_step,
        "seconds": None,  # set just before writing
    }
    if rdv.rank == 0:
        _write_checkpoint(ddp.module, tokenizer, optimizer, config.output, stats, started)
    return stats


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


# --- entry point ---------------------------------------------------------------------------


def run(config_path: Path, env) -> None:
    """Join, train, write (rank 0), and pass the final barrier. Raises TrainerError."""
    started = time.monotonic()
    import torch.distributed as dist

    rdv = Rendezvous.from_env(env)
    config = TrainConfig.read(config_path)
    device = join(rdv)
    train(config, rdv, device, started)
    # Peers wait here while rank 0 writes; a rank 0 that dies on the way makes this fail.
    try:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
    except Exception as e:
        raise TrainerError(f"final barrier failed (a peer died or timed out): {type(e).__name__}: {e}") from None
    # No destroy_process_group(): rank 0 hosts the TCPStore, and when it tears down and exits
    # while a peer is still inside its own teardown, the peer's store thread aborts the process
    # ("terminate called without an active exception", exit -6). Everything durable is
    # written before the barrier above, so the process simply ends (see __main__).


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.train.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-config", required=True, type=Path, help="the train config JSON written by the orchestrator")
    args = parser.parse_args(argv)
    who = f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s trainer {who} %(levelname)s %(name)s: %(message)s", force=True)
    try:
        run(args.train_config, os.environ)
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
