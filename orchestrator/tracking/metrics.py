"""One iteration's figures as experiment trackers take them: flat names, numbers only.

Read from the iteration's ``summary.json`` once it is complete (the update's figures are
copied there at publish, the eval metrics at eval) and from the master's phase times. The
names follow the peers' habits (verl, prime-rl), grouped by a prefix::

    reward/mean                        the train rollout's mean reward
    eval/accuracy, eval/pass_at_K      when the iteration was evaluated (also eval/response_length, eval/tokens_per_s,
                                       and eval/turns with rl.environment, eval/env/<name> for its Step.metrics,
                                       eval/accuracy/<source> and eval/mean_reward/<source> per task data_source)
    train/loss, train/kl, train/entropy, train/clip_fraction, train/grad_norm   means over the update's steps
    train/is_ratio_mean, train/is_ratio_max, train/is_capped_fraction           with rl.is_correction
    distill/reverse_kl                 with rl.teacher: the mean per-token reverse KL to the teacher of the trained tokens
    rollout/response_length, rollout/tokens_per_s, rollout/zero_advantage_groups, rollout/filtered_groups,
    rollout/overlong_samples, rollout/staleness
    rollout/carried_groups, rollout/carried_in_groups, rollout/dropped_groups, rollout/dropped_tokens,
    rollout/token_age_max, rollout/token_age_mean   with rollout.partial (the groups carried out of and into
                                       the iteration, those past the staleness bound, the trained tokens' policy ages)
    timing_s/<phase>, timing_s/iteration     the master's seconds in each phase, and their sum
    perf/checkpoint_bytes, perf/weights_read_bytes   the checkpoint the update wrote; the weights every engine read
    perf/checkpoint_state_bytes                      of the checkpoint, the training state (optimizer, fp32 master)
    perf/checkpoint_delta_bytes                      of the checkpoint, the weights written as deltas (publish.delta)
    perf/weights_read_bytes_max_node                 the weights read on the node that read the most
                                       to serve a policy in the iteration (ops/timing.py; with LoRA, adapters)
"""

from __future__ import annotations

import math

from orchestrator.data import summary
from orchestrator.phase_table import Phase
from orchestrator.protocol.layout import RunLayout


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def iteration_metrics(layout: RunLayout, iteration: int, phases: dict[str, float] | None = None,
                      moved: dict[str, int] | None = None) -> dict[str, float] | None:
    """The figures of ``iteration``, or None while it is not complete. ``phases``: the master's
    seconds per phase label (``1:rollout``), and ``moved`` the bytes written and read, as
    ops/timing.py gives them."""
    s = summary.read(layout, iteration)
    if not s or not s.get("complete"):
        return None
    out: dict[str, object] = {}
    update = s.get("update") or {}
    out["reward/mean"] = update.get("mean_reward")
    for key in ("loss", "kl", "entropy", "clip_fraction", "grad_norm"):
        out[f"train/{key}"] = update.get(key)
    ratio = s.get("is_ratio") or {}
    out |= {"train/is_ratio_mean": ratio.get("mean"), "train/is_ratio_max": ratio.get("max"),
            "train/is_capped_fraction": ratio.get("capped_fraction")}
    if "distill_reverse_kl" in update:
        out["distill/reverse_kl"] = update["distill_reverse_kl"]
    out["rollout/response_length"] = update.get("response_length")
    for key in ("zero_advantage_groups", "filtered_groups", "overlong_samples"):
        out[f"rollout/{key}"] = update.get(key)
    staleness = s.get("staleness")
    if isinstance(staleness, list) and staleness:
        out["rollout/staleness"] = staleness[-1]
    partial = s.get("partial") or {}
    for name, key in (("carried_groups", "carried_out"), ("carried_in_groups", "carried_in"), ("dropped_groups", "dropped"),
                      ("dropped_tokens", "tokens_dropped"), ("token_age_max", "token_age_max"), ("token_age_mean", "token_age_mean")):
        if key in partial:
            out[f"rollout/{name}"] = partial[key]
    metrics = s.get("metrics") or {}
    if metrics:
        out["eval/accuracy"] = metrics.get("accuracy")
        out[f"eval/pass_at_{metrics.get('k')}"] = metrics.get("pass_at_k")
        out["eval/response_length"] = metrics.get("response_length")
        out["eval/tokens_per_s"] = metrics.get("tokens_per_s")
        if "turns" in metrics:  # multi-turn (rl.environment)
            out["eval/turns"] = metrics["turns"]
        # The environment's own metrics, averaged; accuracy and mean reward per data_source.
        out |= {f"eval/{k}": v for k, v in metrics.items() if k.startswith(("env/", "accuracy/", "mean_reward/"))}
    phases = phases or {}
    rollout_s = phases.get(Phase.ROLLOUT.label)
    sampled = (update.get("response_length") or 0) * (update.get("samples") or 0)
    if rollout_s and sampled:
        out["rollout/tokens_per_s"] = sampled / rollout_s
    for label, seconds in phases.items():
        out[f"timing_s/{label.split(':', 1)[-1]}"] = seconds
    if phases:
        out["timing_s/iteration"] = sum(phases.values())
    if moved:
        out["perf/checkpoint_bytes"], out["perf/weights_read_bytes"] = moved.get("written"), moved.get("read")
        out["perf/checkpoint_state_bytes"] = moved.get("written_state")
        out["perf/checkpoint_delta_bytes"] = moved.get("written_deltas")
        out["perf/weights_read_bytes_max_node"] = max((moved.get("read_per_node") or {}).values(), default=None)
    return {k: v for k, value in out.items() if (v := _number(value)) is not None}
