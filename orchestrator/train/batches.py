"""The iteration's trajectory as the update consumes it: its records read and checked
against the model, every sample encoded (every worker plans every worker's part), and the
log-probs of this worker's samples under the init policy and the reference, computed once
before the first step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.train import grpo, parallel, plan
from orchestrator.train.errors import BadTrainInput
from orchestrator.train.policy import Policy
from orchestrator.train.train_config import TrainConfig

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
    old: dict = field(default_factory=dict)
    ref: dict | None = None

    def collate(self, keys: list[plan.Key], device) -> grpo.Batch:
        """The batch of these samples; an empty pass is sample (0, 0), weighed by zero."""
        return grpo.collate([self.completions[k][s] for k, s in keys or [(0, 0)]], self.pad_id).to(device)

    def lined_up(self, keys: list[plan.Key], which: dict):
        import torch

        return torch.cat([which[key] for key in keys])


def prepare(policy: Policy, config: TrainConfig, records: list[grpo.Record]) -> tuple[Batches, plan.Lengths]:
    """Every record encoded (every worker plans every worker's part), and the log-probs of
    this worker's under the init policy and the reference."""
    rdv, model = policy.rdv, policy.model
    vocab = model.get_input_embeddings().num_embeddings
    _check_vocabulary(records, vocab, config.init_checkpoint)
    completions = [grpo.encode_record(policy.tokenizer, r) for r in records]
    lengths = plan.Lengths(rows=[[len(c.prompt_ids) + len(c.completion_ids) for c in group] for group in completions],
                           completions=[[len(c.completion_ids) for c in group] for group in completions])
    batches = Batches(completions, policy.pad_id)
    passes = plan.logprob_plan(lengths, world_size=rdv.world_size, rank=rdv.rank, budget=config.micro_batch_tokens)
    batches.old = _logprobs(model, batches, passes, config, policy.device)
    if config.uses_kl:
        if config.reference_checkpoint.resolve() == config.init_checkpoint.resolve():
            batches.ref = batches.old
        else:
            batches.ref = _logprobs(policy.reference(config), batches, passes, config, policy.device)
    elif config.kl_coef > 0:
        log.warning("kl_coef is %g but there is no reference checkpoint: no KL term", config.kl_coef)
    return batches, lengths


def _logprobs(model, batches: Batches, passes: list[list[plan.Key]], config: TrainConfig, device) -> dict:
    """Per sample, its completion tokens' log-probs under ``model`` (no grad); every worker
    runs as many passes (FSDP gathers parameters collectively at each)."""
    import torch

    out = {}
    autocast = parallel.autocast(device, strategy=config.strategy, mixed_precision=config.mixed_precision)
    with torch.no_grad():
        for keys in passes:
            with autocast:
                lp = grpo.completion_logprobs(model, batches.collate(keys, device))
            sizes = [len(batches.completions[k][s].completion_ids) for k, s in keys]
            out.update(zip(keys, lp.split(sizes) if keys else ()))
    return out
