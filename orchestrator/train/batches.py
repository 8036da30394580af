"""The iteration's trajectory as the update consumes it: its records read and checked
against the model, every sample encoded (every worker plans every worker's part), and the
log-probs of this worker's samples under the init policy and the reference, computed once
before the first step."""

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
        if max(max(r.prompt_token_ids), *(max(s.token_ids, default=0) for s in r.samples)) >= vocab:
            raise BadTrainInput(f"trajectory record {r.task_id} holds a token id past the model's vocabulary of {vocab}: "
                                f"it was sampled from another model than {model}")


@dataclass(slots=True)
class Batches:
    """The iteration's samples as token ids, and the log-probs of this worker's samples under
    the init policy and the reference, by (record, sample)."""

    completions: list[list[grpo.Completion]]
    pad_id: int
    loss_agg: str = "token_mean"
    old: dict = field(default_factory=dict)
    ref: dict | None = None
    weights: dict | None = None
    """Per sample of this worker, its tokens' importance weights (``is_correction``), or None."""
    is_stats: dict | None = None
    """The importance ratios over every worker's tokens: mean, max, share past the cap."""

    def collate(self, keys: list[plan.Key], device) -> grpo.Batch:
        """The batch of these samples; an empty pass is sample (0, 0), weighed by zero."""
        return grpo.collate([self.completions[k][s] for k, s in keys or [(0, 0)]], self.pad_id, self.loss_agg).to(device)

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
    shaping = grpo.Shaping(config.rl.overlong, config.rl.max_tokens, config.rl.overlong_ramp)
    completions = [grpo.encode_record(policy.tokenizer, r, config.rl.advantage, shaping) for r in records]
    masked = any(not c.trained or c.loss_mask is not None for group in completions for c in group)
    lengths = plan.Lengths(rows=[[len(c.prompt_ids) + len(c.completion_ids) for c in group] for group in completions],
                           completions=[[len(c.completion_ids) for c in group] for group in completions],
                           trained_tokens=[[c.trained_tokens() for c in group] for group in completions] if masked else None)
    batches = Batches(completions, policy.pad_id, config.rl.loss_agg)
    passes = plan.logprob_plan(lengths, world_size=rdv.world_size, rank=rdv.rank, budget=config.train.micro_batch_tokens)
    if config.rl.old_logprobs == "engine":  # the engine's: no forward pass
        batches.old = {key: _engine_logprobs(batches, key, policy.device) for keys in passes for key in keys}
    else:
        batches.old = _logprobs(model, batches, passes, config, policy.device)
    if config.uses_kl:
        same = config.reference_checkpoint.resolve() == config.init_checkpoint.resolve()
        if same and config.rl.old_logprobs == "trainer":
            batches.ref = batches.old
        elif same:
            batches.ref = _logprobs(model, batches, passes, config, policy.device)
        elif lora.is_base_of(policy, config.reference_checkpoint):  # the base under the adapters: no second copy of it
            with lora.adapters_off(model):
                batches.ref = _logprobs(model, batches, passes, config, policy.device)
        else:
            batches.ref = _logprobs(policy.reference(config), batches, passes, config, policy.device)
    elif config.rl.kl_coef > 0:
        log.warning("kl_coef is %g but there is no reference checkpoint: no KL term", config.rl.kl_coef)
    if config.correction != "none":
        batches.weights, batches.is_stats = _importance_weights(batches, config, policy.device)
    return batches, lengths


def _check_behaviour_logprobs(records: list[grpo.Record], what: str) -> None:
    """Every sample carries the engine's log-prob of each token it sampled (checked on every
    rank alike, before any collective); ``what``: the option that needs them."""
    key = what.split("=")[0]
    default = {"is_correction": "none", "old_logprobs": "trainer"}[key]
    for r in records:
        for i, sample in enumerate(r.samples):
            if sample.logprobs is None:
                raise BadTrainInput(f"{what} needs the engine's log-prob of every sampled token, and trajectory "
                                    f"record {r.task_id} sample {i} has none that fit its token_ids (a record written by "
                                    f"hand, or by an engine asked without logprobs): set rl.{key}={default}")


def _engine_logprobs(batches: Batches, key: plan.Key, device):
    import torch

    return torch.tensor(batches.completions[key[0]][key[1]].behaviour_logprobs, dtype=torch.float32, device=device)


def _importance_weights(batches: Batches, config: TrainRequest, device) -> tuple[dict, dict]:
    """This worker's samples' importance weights, and the ratios' statistics over every
    worker's tokens (one reduction that every worker joins)."""
    import torch
    import torch.distributed as dist

    weights = {}
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # ratio sum, tokens, tokens past the cap
    peak = torch.zeros(1, dtype=torch.float64, device=device)
    for key, old in batches.old.items():
        behaviour = _engine_logprobs(batches, key, old.device).to(old.dtype)
        weights[key], ratio = grpo.is_weights(old, behaviour, mode=config.correction, cap=config.rl.is_cap)
        mask = batches.completions[key[0]][key[1]].loss_mask
        if mask is not None:  # an observation's tokens were not sampled: no ratio of theirs counts
            ratio = ratio[torch.tensor(mask, dtype=torch.bool, device=ratio.device)]
        if ratio.numel():
            sums += torch.stack([ratio.double().sum(), torch.tensor(float(ratio.numel()), dtype=torch.float64, device=device),
                                 (ratio > config.rl.is_cap).double().sum()])
            peak = torch.maximum(peak, ratio.double().max().reshape(1))
    dist.all_reduce(sums)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = max(sums[1].item(), 1.0)
    return weights, {"is_ratio_mean": sums[0].item() / tokens, "is_ratio_max": peak.item(),
                     "is_capped_fraction": sums[2].item() / tokens}


def _logprobs(model, batches: Batches, passes: list[list[plan.Key]], config: TrainRequest, device) -> dict:
    """Per sample, its completion tokens' log-probs under ``model`` (no grad); every worker
    runs as many passes (FSDP gathers parameters collectively at each)."""
    import torch

    out = {}
    autocast = parallel.autocast(device, strategy=config.train.strategy, mixed_precision=config.train.mixed_precision)
    with torch.no_grad():
        for keys in passes:
            with autocast:
                lp = grpo.completion_logprobs(model, batches.collate(keys, device))
            sizes = [len(batches.completions[k][s].completion_ids) for k, s in keys]
            out.update(zip(keys, lp.split(sizes) if keys else ()))
    return out
