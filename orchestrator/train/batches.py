"""The iteration's trajectory as the update consumes it: its records read and checked
against the model, every sample encoded (every worker plans every worker's part), and the
log-probs of every sample under the init policy and the reference, computed once before the
first step: each worker computes its share (train/plan.py deals them by tokens) and the
workers then exchange them, so that any worker can train on any sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.train import grpo, lora, parallel, plan
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.policy import Policy
from orchestrator.train.request import TrainRequest

log = logging.getLogger(__name__)


def read_records(path: Path) -> list[grpo.Record]:
    """The trajectory aggregate's records; an unreadable or empty one is bad input (exit 2)."""
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
        segments = [max(*seg.prompt_ids, *seg.token_ids) for s in r.samples for seg in s.segments]
        if max(max(r.prompt_token_ids), *(max(s.token_ids, default=0) for s in r.samples), *segments) >= vocab:
            raise BadTrainInput(f"trajectory record {r.task_id} holds a token id past the model's vocabulary of {vocab}: "
                                f"it was sampled from another model than {model}")


@dataclass(slots=True)
class Batches:
    """The iteration's samples as token ids, and the log-probs of every sample under the init
    policy and the reference, by (record, sample)."""

    completions: list[list[grpo.Completion]]
    pad_id: int
    loss_agg: str = "token_mean"
    old: dict = field(default_factory=dict)
    ref: dict | None = None
    weights: dict | None = None
    """Per sample, its tokens' importance weights (``is_correction``), or None."""
    is_stats: dict | None = None
    """The importance ratios over every sample's tokens: mean, max, share past the cap."""

    def collate(self, micro_batch: plan.MicroBatch, device) -> grpo.Batch:
        """The batch of these rows; an empty pass is sample (0, 0), weighed by zero."""
        rows = micro_batch or [[(0, 0)]]
        return grpo.collate_rows([[self.completions[k][s] for k, s in row] for row in rows], self.pad_id, self.loss_agg).to(device)

    def lined_up(self, keys: list[plan.Key], which: dict):
        import torch

        return torch.cat([which[key] for key in keys])


def trained_records(records: list[grpo.Record], config: TrainRequest) -> list[grpo.Record]:
    """The records the update trains on: all, or with ``filter_groups`` the informative ones."""
    return [r for r in records if grpo.informative(r)] if config.rl.filter_groups else records


def prepare(policy: Policy, config: TrainRequest, records: list[grpo.Record]) -> tuple[Batches, plan.Lengths]:
    """Every record encoded (every worker plans every worker's part), and the log-probs of
    this worker's under the init policy and the reference."""
    rdv, model = policy.rdv, policy.model
    vocab = model.get_input_embeddings().num_embeddings
    _check_vocabulary(records, vocab, config.init_checkpoint)
    if config.engine_logprobs_needed:
        _check_behaviour_logprobs(records, config.engine_logprobs_needed)
    if config.rl.distill_coef > 0:
        check_teacher_logprobs(records, config.rl.distill_coef)
    shaping = grpo.Shaping(config.rl.overlong, config.rl.max_tokens, config.rl.overlong_ramp)
    distillation = grpo.Distillation(config.rl.distill_coef, config.rl.distill_only)
    completions = [grpo.encode_record(policy.tokenizer, r, config.rl.advantage, shaping, distillation) for r in records]
    masked = any(not c.trained or c.loss_mask is not None for group in completions for c in group)
    lengths = plan.Lengths(rows=[[len(c.prompt_ids) + len(c.completion_ids) for c in group] for group in completions],
                           completions=[[len(c.completion_ids) for c in group] for group in completions],
                           trained_tokens=[[c.trained_tokens() for c in group] for group in completions] if masked else None)
    batches = Batches(completions, policy.pad_id, config.rl.loss_agg)
    passes = plan.logprob_plan(lengths, world_size=rdv.world_size, budget=config.train.micro_batch_tokens, packing=config.train.packing)
    if config.rl.old_logprobs == "engine":  # the engine's: no forward pass
        batches.old = {key: _engine_logprobs(batches, key, policy.device) for key in plan.every_sample(lengths)}
    else:
        batches.old = _logprobs(model, batches, passes, rdv, config, policy.device)
    if config.uses_kl:
        same = config.reference_checkpoint.resolve() == config.init_checkpoint.resolve()
        if same and config.rl.old_logprobs == "trainer":
            batches.ref = batches.old
        elif same:
            batches.ref = _logprobs(model, batches, passes, rdv, config, policy.device)
        elif lora.is_base_of(policy, config.reference_checkpoint):  # the base under the adapters: no second copy of it
            with lora.adapters_off(model):
                batches.ref = _logprobs(model, batches, passes, rdv, config, policy.device)
        else:
            batches.ref = _logprobs(policy.reference(config), batches, passes, rdv, config, policy.device)
    elif config.rl.kl_coef > 0:
        log.warning("kl_coef is %g but there is no reference checkpoint: no KL term", config.rl.kl_coef)
    if config.correction != "none":
        batches.weights, batches.is_stats = _importance_weights(batches, config)
    return batches, lengths


def _check_behaviour_logprobs(records: list[grpo.Record], what: str) -> None:
    """Every sample carries the engine's log-prob of each token it sampled (checked on every
    rank alike, before any collective); ``what``: the option that needs them."""
    key = what.split("=")[0]
    default = {"is_correction": "none", "old_logprobs": "trainer", "distill_coef": "0"}[key]
    for r in records:
        for i, sample in enumerate(r.samples):
            if sample.logprobs is None or any(seg.logprobs is None for seg in sample.segments):
                raise BadTrainInput(f"{what} needs the engine's log-prob of every sampled token, and trajectory "
                                    f"record {r.task_id} sample {i} has none that fit its token_ids (a record written by "
                                    f"hand, or by an engine asked without logprobs): set rl.{key}={default}")


def check_teacher_logprobs(records: list[grpo.Record], coef: float) -> None:
    """Every sample, and every earlier segment of an agent's, carries the teacher's log-prob
    of each token it sampled (checked on every rank alike, before any collective)."""
    for r in records:
        for i, sample in enumerate(r.samples):
            parts = [(f"sample {i}", sample), *((f"sample {i} segment {j}", seg) for j, seg in enumerate(sample.segments))]
            for where, part in parts:
                if part.teacher_logprobs is None:
                    raise BadTrainInput(f"rl.distill_coef={coef:g} trains toward the teacher's log-prob of every sampled token, "
                                        f"and trajectory record {r.task_id} {where} has no teacher_logprobs that fit its token_ids "
                                        f"(one per token id): roll out with rl.teacher set, which records them, or set "
                                        f"rl.distill_coef=0")


def _engine_logprobs(batches: Batches, key: plan.Key, device):
    import torch

    return torch.tensor(batches.completions[key[0]][key[1]].behaviour_logprobs, dtype=torch.float32, device=device)


def _importance_weights(batches: Batches, config: TrainRequest) -> tuple[dict, dict]:
    """Every sample's importance weights, and the ratios' statistics over every sample's
    tokens (every worker holds every sample's old log-probs, so computes the same)."""
    import torch

    weights = {}
    ratios = []
    for key, old in batches.old.items():
        behaviour = _engine_logprobs(batches, key, old.device).to(old.dtype)
        weights[key], ratio = grpo.is_weights(old, behaviour, mode=config.correction, cap=config.rl.is_cap)
        mask = batches.completions[key[0]][key[1]].loss_mask
        if mask is not None:  # an observation's tokens were not sampled: no ratio of theirs counts
            ratio = ratio[torch.tensor(mask, dtype=torch.bool, device=ratio.device)]
        ratios.append(ratio.double())
    every = torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)  # one read back, not one a sample
    tokens = max(every.numel(), 1)
    return weights, {"is_ratio_mean": every.sum().item() / tokens, "is_ratio_max": every.max().item() if every.numel() else 0.0,
                     "is_capped_fraction": (every > config.rl.is_cap).sum().item() / tokens}


def _logprobs(model, batches: Batches, passes: list[list[plan.MicroBatch]], rdv, config: TrainRequest, device) -> dict:
    """Per sample, its completion tokens' log-probs under ``model`` (no grad): this worker runs
    its passes (every worker as many: FSDP gathers parameters collectively at each), then the
    workers exchange what they computed. ``passes``: every worker's, indexed by worker."""
    import torch

    out = {}
    autocast = parallel.autocast(device, strategy=config.train.strategy, mixed_precision=config.train.mixed_precision)
    with torch.no_grad():
        for micro_batch in passes[rdv.rank]:
            with autocast:
                lp = grpo.completion_logprobs(model, batches.collate(micro_batch, device), head_at_targets=config.train.packing)
            keys = plan.keys_of(micro_batch)
            sizes = [len(batches.completions[k][s].completion_ids) for k, s in keys]
            out.update(zip(keys, lp.split(sizes) if keys else ()))
    if rdv.world_size == 1:
        return out
    return _exchange(out, batches, passes, rdv.rank, device)


def _exchange(mine: dict, batches: Batches, passes: list[list[plan.MicroBatch]], rank: int, device) -> dict:
    """Every worker's log-probs, from each worker's own: one all-gather of the flat tensors,
    padded to the longest (every worker knows every other's passes, so their sizes)."""
    import torch
    import torch.distributed as dist

    keys = [[key for micro_batch in worker for key in plan.keys_of(micro_batch)] for worker in passes]
    sizes = [[len(batches.completions[k][s].completion_ids) for k, s in worker] for worker in keys]
    longest = max(1, *map(sum, sizes))
    flat = torch.cat([mine[key].float() for key in keys[rank]] or [torch.zeros(0, device=device)])
    flat = torch.cat([flat, flat.new_zeros(longest - flat.numel())])
    gathered = [torch.empty_like(flat) for _ in passes]
    dist.all_gather(gathered, flat)
    out = {}
    for worker, (worker_keys, worker_sizes) in enumerate(zip(keys, sizes)):
        out.update(zip(worker_keys, gathered[worker][: sum(worker_sizes)].split(worker_sizes)))
    return out
