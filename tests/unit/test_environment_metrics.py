"""An environment's per-episode metrics (``Step.metrics``, recorded per sample) averaged in
eval's metrics as ``env/<name>``, and accuracy and mean reward per task ``data_source``
(``accuracy/<source>``), sent to the trackers under ``eval/``."""

from __future__ import annotations

import json
from types import SimpleNamespace

from orchestrator.data import summary
from orchestrator.protocol.layout import RunLayout
from orchestrator.tracking.metrics import iteration_metrics
from orchestrator.workloads.rl.workload import RLWorkload


def _sample(reward: float, metrics: dict | None = None) -> dict:
    sample = {"text": "x", "token_ids": [1, 2], "reward": reward, "logprobs": [-0.1, 0.0], "loss_mask": [1, 0],
              "turns": [{"text": "x", "tokens": 1}]}
    return sample | ({"metrics": metrics} if metrics is not None else {})


def test_eval_averages_each_metric_over_the_samples_that_gave_it_and_the_trackers_get_it(tmp_path):
    records = tmp_path / "eval.jsonl"
    rows = [{"rank": 0, "sent_at": 0.0, "seconds": 1.0, "samples": [_sample(1.0, {"calls": 2, "solved": 1}), _sample(0.0, {"calls": 4})]},
            {"rank": 1, "sent_at": 0.0, "seconds": 1.0, "samples": [_sample(0.5), _sample(0.0, {"calls": 0, "solved": 0})]}]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = SimpleNamespace(rl=SimpleNamespace(eval_samples=2))
    metrics = RLWorkload.metrics(workload, None, records)
    assert metrics["env/calls"] == 2.0 and metrics["env/solved"] == 0.5, metrics
    assert metrics["turns"] == 1.0 and metrics["mean_reward"] == 0.375

    layout = RunLayout(tmp_path / "run")
    summary.update(layout, 3, complete=True, metrics=metrics)
    tracked = iteration_metrics(layout, 3)
    assert tracked["eval/env/calls"] == 2.0 and tracked["eval/env/solved"] == 0.5 and tracked["eval/turns"] == 1.0

    plain = tmp_path / "plain.jsonl"  # no environment metrics: no env/ names
    plain.write_text(json.dumps({**rows[0], "samples": [_sample(1.0)]}) + "\n")
    assert not [k for k in RLWorkload.metrics(workload, None, plain) if k.startswith("env/")]


def test_eval_breaks_accuracy_and_mean_reward_down_by_data_source(tmp_path):
    records = tmp_path / "eval.jsonl"
    rows = [{"rank": 0, "sent_at": 0.0, "seconds": 1.0, "data_source": "lcm", "samples": [_sample(1.0), _sample(0.5)]},
            {"rank": 0, "sent_at": 0.0, "seconds": 1.0, "data_source": "basic_arithmetic", "samples": [_sample(0.0), _sample(0.0)]},
            {"rank": 1, "sent_at": 0.0, "seconds": 1.0, "data_source": "lcm", "samples": [_sample(1.0), _sample(1.0)]}]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = RLWorkload.metrics(SimpleNamespace(rl=SimpleNamespace(eval_samples=2)), None, records)
    assert metrics["accuracy/lcm"] == 0.75 and metrics["mean_reward/lcm"] == 0.875, "partial credit counts in the mean, not the accuracy"
    assert metrics["accuracy/basic_arithmetic"] == 0.0 and metrics["accuracy"] == 0.5
    layout = RunLayout(tmp_path / "run")
    summary.update(layout, 1, complete=True, metrics=metrics)
    tracked = iteration_metrics(layout, 1)
    assert tracked["eval/accuracy/lcm"] == 0.75 and tracked["eval/mean_reward/basic_arithmetic"] == 0.0
