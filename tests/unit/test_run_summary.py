"""The master's closing line of a completed run (data/summary.py's ``closing``): its
iterations, the eval curve's ends, the time, and where the report and checkpoints are."""

from __future__ import annotations

from orchestrator.data import summary
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout


def _run(tmp_path, iterations: int, evals: dict[int, float], checkpoint: bool = True) -> RunLayout:
    layout = RunLayout(tmp_path / "run")
    fsio.write_record(layout.progress, {"attempt": "a000001-x", "iteration": iterations, "phase": 13, "training": []})
    for i, accuracy in evals.items():
        summary.append_metrics(layout, i, {"accuracy": accuracy, "mean_reward": accuracy, "tasks": 8})
    summary.update(layout, iterations, checkpoint=f"checkpoints/iter-{iterations:06d}" if checkpoint else None, complete=True)
    return layout


def test_the_closing_line_names_iterations_eval_ends_time_checkpoint_and_report(tmp_path):
    layout = _run(tmp_path, 10, {1: 0.2625, 4: 0.5, 7: 0.6, 10: 0.66})
    assert summary.closing(layout, seconds=83.4, resumed_at=1) == (
        f"run complete: 10 iterations in 83 s; eval accuracy 0.263 at iteration 1, 0.66 at iteration 10; its last checkpoint "
        f"is {layout.root}/checkpoints/iter-000010; see it with `orchestrator report --log-path {layout.root}`")


def test_a_resumed_run_says_its_time_is_this_starts_and_a_run_without_eval_or_checkpoint_says_neither(tmp_path):
    layout = _run(tmp_path, 3, {}, checkpoint=False)
    assert summary.closing(layout, seconds=12, resumed_at=2) == (
        f"run complete: 3 iterations in 12 s (this start, from iteration 2); see it with `orchestrator report --log-path {layout.root}`")


def test_one_eval_is_named_once_and_a_rehearsals_is_said_to_be_simulated(tmp_path):
    layout = _run(tmp_path, 1, {1: 0.25})
    assert summary.closing(layout, seconds=1, simulated=True).startswith(
        "run complete: 1 iteration in 1 s; simulated eval accuracy 0.25 at iteration 1; its last checkpoint")
