"""The README's main job learns on every machine and seed: demo-data lands the base model in
its accuracy band, and ten RL iterations lift eval accuracy by at least 20 points.

Two cases: seed 0 with this CPU's kernels, and seed 1 under ATEN_CPU_CAPABILITY=default,
which makes torch use other kernels (as another CPU would), so a figure that holds only on
one machine's floating point fails here. docs/rl.md has the table for seeds 0-4.

The README's chat demo (a Qwen2 with a BPE tokenizer and a chat template, the math reward)
lifts it by at least 10 points by iteration 4: one case here, seed 1 with this CPU's kernels,
the smallest gain measured (+0.19 at iteration 4, +0.34 at 10), four iterations rather than
ten to spare the suite's time; docs/demo.md has the others, under the default kernels too.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, status_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

README = Path(__file__).resolve().parents[2] / "README.md"


def _main_job_steps() -> list[str]:
    """The README's first command, without its install (done by the test set-up)."""
    command = re.search(r"^    (python3 -m pip install .* && python3 -m orchestrator demo-data .*)$", README.read_text(), re.M).group(1)
    return command.split(" && ")[1:]


def _chat_demo_steps(iterations: int) -> list[str]:
    command = re.search(r"^    (python3 -m orchestrator demo-data --chat .*)$", README.read_text(), re.M).group(1)
    assert command.endswith(" --max-iterations 10"), command
    return (command.removesuffix("10") + str(iterations)).split(" && ")


def _run_steps(steps, tmp_path, seed, kernels, paths):
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kernels:
        env["ATEN_CPU_CAPABILITY"] = kernels
    for step in steps:
        for readme_path, name in paths.items():
            step = step.replace(readme_path, str(tmp_path / name))
        argv = step.split()
        assert argv[:3] == ["python3", "-m", "orchestrator"] and argv[3] in ("demo-data", "run"), step
        argv += [f"--seed={seed}"] if argv[3] == "demo-data" else [f"seed={seed}"]
        result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=850, env=env)
        assert result.returncode == 0, result.stderr[-4000:]


def _curve(log, evaluated_at=(1, 4, 7, 10)):
    evaluated = [it for it in status_json(log)["iterations"] if it["evaluated"]]
    assert [it["iteration"] for it in evaluated] == list(evaluated_at)
    return [round(it["metrics"]["accuracy"], 3) for it in evaluated]


@pytest.mark.parametrize("seed,kernels", [(0, None), (1, "default")], ids=["seed0-native-kernels", "seed1-default-kernels"])
def test_readme_main_job_lands_in_the_band_and_lifts_eval_accuracy_by_twenty_points(tmp_path, seed, kernels, request):
    data, log = tmp_path / "data", tmp_path / "run"
    steps, made_s = _main_job_steps(), 0.0
    if seed == 0 and kernels is None:
        # The README's demo-data step with the default seed is the session's readme_demo_data
        # (shared with tests/system/test_fsdp_run.py): check that it is that step, then run the rest.
        assert steps[0].split() == ["python3", "-m", "orchestrator", "demo-data", "--data-path", "/tmp/orch-data"], steps[0]
        made = request.getfixturevalue("readme_demo_data")
        data, steps, made_s = made.path, steps[1:], made.seconds
    started = time.monotonic()
    _run_steps(steps, tmp_path, seed, kernels, {"/tmp/orch-data": str(data), "/tmp/orch-run": "run"})
    assert made_s + time.monotonic() - started < 15 * 60

    demo = json.loads((data / "demo.json").read_text())
    low, high = demo["settings"]["accuracy_band"]
    assert demo["seed"] == seed and low <= demo["validation_accuracy"] <= high, demo
    curve = _curve(log)
    assert curve[-1] - curve[0] >= 0.20, f"seed {seed}, kernels {kernels or 'native'}: eval accuracy {curve}"


def test_readme_chat_demo_lifts_eval_accuracy_by_ten_points_with_the_math_reward(tmp_path):
    data, log = tmp_path / "chat", tmp_path / "chat-run"
    _run_steps(_chat_demo_steps(iterations=4), tmp_path, 1, None, {"/tmp/orch-chat-run": "chat-run", "/tmp/orch-chat": "chat"})
    demo = json.loads((data / "demo.json").read_text())
    low, high = demo["settings"]["accuracy_band"]
    assert demo["settings"]["chat"] and low <= demo["validation_accuracy"] <= high, demo
    curve = _curve(log, (1, 4))
    assert curve[-1] - curve[0] >= 0.10, f"chat demo, seed 1: eval accuracy {curve}"
    layout = RunLayout(log)
    records = aggregate_records(layout, 4)
    assert all(r["prompt"].startswith("<|im_start|>user\n") and r["prompt_token_ids"] for r in records)
    from transformers import AutoConfig, AutoTokenizer

    final = layout.checkpoint(4)  # its weights may be a delta (publish.delta): its config and tokenizer are whole
    assert AutoConfig.from_pretrained(final).model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(final).chat_template, "the final checkpoint keeps the chat template"
