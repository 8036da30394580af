"""One iteration's GRPO update of a train worker's policy: the trajectory read, the policy
loaded or kept, the log-probs computed once, the optimizer steps as train/plan.py cuts them
(each the token mean over every worker's part), and the checkpoint written. Returns what
the ``done`` answer carries: the stats, the seconds of each part and the memory used."""

from __future__ import annotations

import dataclasses
import logging
import time

from orchestrator.phase_table import Phase
from orchestrator.protocol import faults
from orchestrator.train import checkpoint_writer, grpo, lora, parallel, plan, precision
from orchestrator.train.batches import Batches, prepare, read_records, trained_records
from orchestrator.train.policy import Policy
from orchestrator.train.request import TrainRequest

log = logging.getLogger(__name__)


class _Laps:
    """Seconds spent in each part of the update, in the order the parts came."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.monotonic()

    def __call__(self, part: str) -> None:
        now = time.monotonic()
        self.seconds[part] = round(self.seconds.get(part, 0.0) + now - self._mark, 4)
        self._mark = now


def update(policy: Policy, config: TrainRequest, started: float) -> tuple[dict, dict, dict]:
    """The GRPO update (train/plan.py says how it is cut up); the checkpoint written (by
    worker 0, or by every worker's shard with FSDP). Returns (stats, seconds per part,
    memory); the stats are complete on worker 0. ``started``: when this update began
    (monotonic)."""
    lap = _Laps()
    records = read_records(config.data)
    kept = trained_records(records, config)
    source = policy.load(config)
    lap("load")
    replayed = None
    if source == "state":  # the init checkpoint holds no training state: train the iterations since the last one again
        replayed = _replay(policy, config)
        source = f"replayed {replayed[0]}..{replayed[1]}"
        lap("replay")
    base = checkpoint_writer.delta_base(policy, config)  # the version this one may be published as a delta against
    lap("load")
    batches, lengths, steps, per_step, memory = _train(policy, config, records, kept, source, lap)
    stats = _stats(policy, config, records, kept, lengths, steps, source, per_step)
    if replayed:
        stats["replayed"] = replayed
    stats |= _options(config)
    if config.correction != "none":
        stats |= {"is_correction": config.correction, "is_cap": config.rl.is_cap,
                  **{k: round(v, 6) for k, v in (batches.is_stats if batches else {}).items()}}
    if config.rl.distill_coef > 0:
        stats |= _distillation(batches, policy.rdv.rank)
    checkpoint_writer.write(policy, config, stats, started, base)
    del base
    lap("checkpoint")
    policy.holds = config.iteration
    if config.offload:
        policy.offload()
        lap("offload")
    memory["peak_rss_bytes"] = _peak_rss_bytes()
    return stats, lap.seconds, memory


def _replay(policy: Policy, config: TrainRequest) -> list[int]:
    """The updates of ``config.replay`` made again in order on the policy loaded from the
    state before them, each as it was made (its records, its seed); returns [first, last]."""
    first, last = config.replay[0].iteration, config.replay[-1].iteration
    log.info("rank %d: replaying iterations %d..%d from their aggregates (the state of %s) to reach iteration %d's state",
             policy.rdv.rank, first, last, f"iteration {config.replay_from_iteration}" if config.replay_from_iteration else "the base model",
             config.init_iteration)
    for step in config.replay:
        again = dataclasses.replace(config, iteration=step.iteration, data=step.data, seed=step.seed, init_iteration=step.iteration - 1,
                                    replay=())
        records = read_records(again.data)
        _train(policy, again, records, trained_records(records, again), "memory")
        policy.holds = step.iteration
        policy.count_steps()
        faults.hold_in_child("hold-in-replay", config.iteration, Phase.TRAIN, log)
    return [first, last]


def _train(policy: Policy, config: TrainRequest, records: list[grpo.Record], kept: list[grpo.Record], source: str,
           lap=lambda part: None):
    """The update of ``config.iteration`` on the policy in memory (loaded): seeded, the
    log-probs computed, the optimizer steps made. Returns (batches, lengths, steps, each
    step's figures, memory); an update with nothing to train leaves the policy as it is."""
    import torch

    rdv = policy.rdv
    torch.manual_seed(config.seed)  # after loading, which may draw from it: memory and checkpoint alike
    policy.holds = None  # from here until the update is complete, memory holds no known iteration
    for group in policy.optimizer.param_groups:
        group["lr"] = config.rl.lr
    if not kept:  # every worker reads the same records, so every worker takes this branch alike
        log.warning("iteration %d: none of the %d groups has rewards that vary, and rl.filter_groups leaves them all out: "
                    "the policy and optimizer stay as they are", config.iteration, len(records))
        return None, None, [[]], {key: [] for key in _PER_STEP}, {}
    batches, lengths = prepare(policy, config, kept)
    steps = _update_plan(lengths, config, rdv.world_size, rdv.rank)
    lap("prepare")
    sync = parallel.Sync(policy.model, strategy=config.train.strategy, device=policy.device)
    log.info("rank %d: %s (%s)", rdv.rank, "a fresh optimizer" if policy.continued_from is None else
             f"optimizer continued from step {policy.continued_from}", "in memory" if source == "memory" else f"loaded from {config.init_checkpoint}")
    log.info("rank %d: %d records, %d epochs x %d steps of %d records; %s, %s compute, %s master weights and optimizer state%s "
             "(served in %s)%s", rdv.rank, len(kept), config.rl.epochs, len(steps[0]), config.rl.micro_batch, config.train.strategy,
             config.train.mixed_precision, precision.MASTER, _frozen(policy), policy.served_dtype,
             ", activation checkpointing" if config.train.activation_checkpointing else "")
    if config.train.lora_dropout:
        lora.dropout(policy.model, True)  # in the steps' forward passes only
    try:
        per_step, memory = _optimizer_steps(policy, config, batches, steps, sync)
    finally:
        if config.train.lora_dropout:
            lora.dropout(policy.model, False)
    del sync
    lap("steps")
    return batches, lengths, steps, per_step, memory


def _update_plan(lengths: plan.Lengths, config: TrainRequest, world_size: int, rank: int) -> list[list[plan.Step]]:
    return plan.update_plan(lengths, world_size=world_size, rank=rank, batch_records=config.rl.micro_batch,
                            budget=config.train.micro_batch_tokens, seed=config.seed, epochs=config.rl.epochs,
                            packing=config.train.packing)


def _padding_share(lengths: plan.Lengths, config: TrainRequest, world_size: int) -> float:
    """The share of the tokens the update's forward passes compute, every worker's, that are
    padding (the log-prob passes' is alike)."""
    micro_batches = [mb for rank in range(world_size) for epoch in _update_plan(lengths, config, world_size, rank)
                     for step in epoch for mb in step.micro_batches if mb]
    pairs = [plan.tokens(mb, lengths.rows) for mb in micro_batches]
    real, computed = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return round(1 - real / computed, 4) if computed else 0.0


_PER_STEP = ("loss", "kl", "clip_fraction", "entropy", "grad_norm", "tokens", "micro_batches")


def _options(config: TrainRequest) -> dict:
    """The update's options away from their defaults, as ``train_stats.json`` names them."""
    chosen = {"advantage": (config.rl.advantage, "grpo"), "clip": (list(config.rl.clip), [config.rl.clip_eps] * 2),
              "kl_estimator": (config.rl.kl_estimator, "k3"), "old_logprobs": (config.rl.old_logprobs, "trainer"),
              "loss_agg": (config.rl.loss_agg, "token_mean"), "ratio_level": (config.rl.ratio_level, "token"),
              "overlong": (config.rl.overlong, "keep"), "filter_groups": (config.rl.filter_groups, False),
              "distill_coef": (config.rl.distill_coef, 0.0), "distill_only": (config.rl.distill_only, False)}
    out = {key: value for key, (value, default) in chosen.items() if value != default}
    if config.rl.overlong == "penalty":
        out["overlong_buffer"] = config.rl.overlong_ramp
    return out


def _distillation(batches: Batches | None, rank: int) -> dict:
    """``distill_reverse_kl``: the mean over the trained tokens of the engine's log-prob of the
    sampled token less the teacher's (None when nothing was trained)."""
    reverse_kl = grpo.mean_reverse_kl([c for group in batches.completions for c in group]) if batches else None
    if rank == 0 and reverse_kl is not None:
        log.info("distillation: mean per-token reverse KL to the teacher over the trained tokens %.5f", reverse_kl)
    return {"distill_reverse_kl": None if reverse_kl is None else round(reverse_kl, 6)}


def _optimizer_steps(policy: Policy, config: TrainRequest, batches: Batches, steps: list[list[plan.Step]],
                     sync: parallel.Sync) -> tuple[dict[str, list], dict]:
    """Every epoch's steps. Returns each step's loss, KL, clip fraction, gradient norm, tokens
    and micro-batches over all workers, and the bytes the model and optimizer hold after the
    last step (when the optimizer state is complete)."""
    rank = policy.rdv.rank
    autocast = parallel.autocast(policy.device, strategy=config.train.strategy, mixed_precision=config.train.mixed_precision)
    per_step: dict[str, list] = {key: [] for key in _PER_STEP}
    memory: dict = {}
    for epoch, epoch_steps in enumerate(steps):
        for number, step in enumerate(epoch_steps):
            sums, grad_norm = _step(policy, config, batches, step, sync, autocast)
            if not memory and epoch == len(steps) - 1 and number == len(epoch_steps) - 1:
                memory = parallel.storage_bytes(policy.model, policy.optimizer)
            loss, kl, clip_fraction, entropy, tokens = _over_all_workers(sums)
            for key, value in zip(per_step, (loss, kl if config.uses_kl else None, clip_fraction, entropy, grad_norm, tokens,
                                             len(step.micro_batches))):
                per_step[key].append(value)
            if rank == 0:
                log.info(
                    "iteration %d epoch %d step %d/%d: loss %.5f%s clip %.3f grad_norm %.3f tokens %d in %d micro-batches",
                    config.iteration, epoch, number + 1, len(epoch_steps), loss, f" kl {kl:.5f}" if config.uses_kl else "", clip_fraction,
                    grad_norm, tokens, len(step.micro_batches),
                )
    policy.optimizer.zero_grad(set_to_none=True)
    return per_step, memory


def _step(policy: Policy, config: TrainRequest, batches: Batches, step: plan.Step, sync: parallel.Sync, autocast):
    """One optimizer step: this worker's micro-batches, gradients reduced over the workers at
    the last, clipped and applied. Returns this worker's sums over its tokens (loss, k3,
    clipped tokens, tokens) and the gradient norm."""
    import torch

    device = policy.device
    policy.optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    world_size = policy.rdv.world_size
    normalizer = step.normalizer(config.rl.loss_agg, world_size)
    for slot, micro_batch in enumerate(step.micro_batches):
        keys = plan.keys_of(micro_batch)
        with sync.micro_batch(last=slot == len(step.micro_batches) - 1):
            parts, entropy = _micro_batch_loss(config, batches, micro_batch, sync, autocast, normalizer, device)
            (parts.loss if keys else parts.loss * 0.0).backward()
        if keys:
            sums += torch.tensor([parts.loss.item() / world_size, (parts.kl or 0.0) * parts.tokens,
                                  parts.clip_fraction * parts.tokens, parts.tokens, entropy.sum().item()], dtype=torch.float64,
                                 device=device)
    grad_norm = sync.clip_grad_norm(config.rl.max_grad_norm)
    policy.optimizer.step()
    return sums, grad_norm


def _micro_batch_loss(config: TrainRequest, batches: Batches, micro_batch: plan.MicroBatch, sync: parallel.Sync, autocast,
                      normalizer: float, device):
    """The GRPO loss of one micro-batch under the model being trained, and the policy's entropy
    at each of its tokens; an empty one (a worker with no part in this step) still runs the
    forward, so every worker joins the reduction."""
    batch = batches.collate(micro_batch, device)
    keys = plan.keys_of(micro_batch)
    with autocast:
        new_lp, entropy = grpo.completion_logprobs(sync.module, batch, entropy=True, head_at_targets=config.train.packing)
    old_lp = batches.lined_up(keys, batches.old) if keys else new_lp.detach()
    ref_lp = (batches.lined_up(keys, batches.ref) if keys else new_lp.detach()) if batches.ref is not None else None
    weights = (batches.lined_up(keys, batches.weights) if keys else None) if batches.weights is not None else None
    low, high = config.rl.clip
    return grpo.grpo_loss(new_lp, old_lp, batch.advantages, clip_eps=low, clip_eps_high=high, kl_coef=config.rl.kl_coef,
                          ref_logprobs=ref_lp, normalizer=normalizer, weights=weights, kl_estimator=config.rl.kl_estimator,
                          ratio_level=config.rl.ratio_level, lengths=batch.lengths, scale=batch.scale,
                          loss_agg=config.rl.loss_agg, mask=batch.mask), (entropy if keys else entropy[:0])


def _over_all_workers(sums) -> tuple[float, float, float, float, int]:
    """Every worker's sums added up: the step's loss, its token means of the KL estimate,
    clipping and entropy, and its tokens."""
    import torch.distributed as dist

    dist.all_reduce(sums)
    total = max(sums[3].item(), 1.0)
    kl, clip_fraction = (x / total for x in sums[1:3].tolist())
    return sums[0].item(), kl, clip_fraction, sums[4].item() / total, int(sums[3].item())


def _stats(policy: Policy, config: TrainRequest, records: list[grpo.Record], kept: list[grpo.Record], lengths: plan.Lengths | None,
           steps: list[list[plan.Step]], source: str, per_step: dict[str, list]) -> dict:
    """What ``train_stats.json`` says of the update; ``seconds`` is set just before it is written."""
    samples = [s for r in records for s in r.samples]
    stats = {
        "iteration": config.iteration,
        "world_size": policy.rdv.world_size,
        "strategy": config.train.strategy,
        "mixed_precision": config.train.mixed_precision,
        "master_dtype": precision.MASTER,
        "served_dtype": policy.served_dtype,
        "published_dtype": precision.published_dtype(policy.served_dtype, config.publish_dtype, adapter=policy.setup.lora),
        "activation_checkpointing": config.train.activation_checkpointing,
        "records": len(records),
        "samples": len(samples),
        "completion_tokens": sum(map(sum, lengths.completions)) if lengths else 0,  # of the samples trained
        "trained_samples": sum(len(r.samples) for r in kept),
        "sampled_tokens": sum(len(s.token_ids) for s in samples if s.token_ids is not None),  # every sample with the engine's ids
        "mean_reward": sum(s.reward for s in samples) / len(samples),
        "zero_advantage_groups": sum(1 for r in records if not grpo.informative(r)),
        "records_tokenized_from_text": sum(1 for r in records if r.prompt_token_ids is None),
        "epochs": config.rl.epochs,
        "steps_per_epoch": len(steps[0]),
        "micro_batch": config.rl.micro_batch,
        "micro_batch_tokens": config.train.micro_batch_tokens,
        "packing": config.train.packing,
        "padding_share": _padding_share(lengths, config, policy.rdv.world_size) if lengths else 0.0,
        "optimizer_continued_from_step": policy.continued_from,
        "policy_from": source,
        **per_step,
        "seconds": None,
    }
    if config.train.lora_rank:
        stats |= {"lora_rank": config.train.lora_rank, "lora_alpha": config.train.lora_alpha, "frozen_dtype": precision.frozen_dtype(policy.model),
                  "trainable_parameters": sum(p.numel() for p in policy.model.parameters() if p.requires_grad)}
    if config.rl.filter_groups:
        stats["filtered_groups"] = len(records) - len(kept)
    truncated = sum(1 for s in samples if s.finish_reason == "length")
    if config.rl.overlong != "keep":
        stats["overlong_samples"] = truncated  # masked, or penalised by their length (with the others past the ramp's start)
    return stats


def _frozen(policy: Policy) -> str:
    frozen = precision.frozen_dtype(policy.model)
    return f", the frozen base in {frozen}" if frozen else ""


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
