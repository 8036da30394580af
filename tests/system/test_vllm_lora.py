"""LoRA through real vLLM (its CPU build): vLLM starts on the base with --enable-lora, takes
each iteration's adapter in place under a new name (/v1/load_lora_adapter), drops the one
before, and never loads the base again; the samples of each iteration are those of the
adapter trained before it, as the merged model that `orchestrator export` writes computes them.

Needs vLLM (scripts/setup-vllm.sh); out of the default test run: ``python -m pytest -m vllm``.
"""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from orchestrator.protocol.layout import RunLayout
from tests.system.test_vllm_rl_loop import SETTINGS, _forward_logprobs, _max_error

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: run scripts/setup-vllm.sh"),
]


def test_vllm_serves_each_lora_adapter_in_place_without_reloading_the_base(demo_data, tmp_path):
    log_path = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", f"--data-path={demo_data}", f"--log-path={log_path}", "--rl-phase=both",
         "--eval-interval=1", "--max-iterations=3", "--engine=vllm", *SETTINGS, "rollout.weight_update=auto", "train.lora_rank=8"],
        capture_output=True, text=True, timeout=840,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    layout = RunLayout(log_path)
    engine_log = layout.engine_log(0, 0).read_text(errors="replace")
    assert re.findall(r"^=== .* start on (\S+) as ", engine_log, flags=re.M) == [str(demo_data / "model")]
    assert len(re.findall(r"Starting to load model", engine_log)) == 1, "vLLM loaded the base model again"
    assert "reload_weights" not in engine_log
    loads = re.findall(r"Loaded new LoRA adapter: name '(\S+)', path '(\S+)'", engine_log)
    assert [path for _, path in loads] == [str(layout.checkpoint(i)) for i in (1, 2)], loads  # one a new iteration
    assert re.findall(r"Removed LoRA adapter: name '(\S+)'", engine_log) == [loads[0][0]]

    for iteration, policy in ((2, 1), (3, 2)):
        out = tmp_path / f"merged-{policy}"
        exported = subprocess.run([sys.executable, "-m", "orchestrator", "export", f"--log-path={log_path}", f"--iteration={policy}",
                                   f"--out={out}"], capture_output=True, text=True, timeout=300)
        assert exported.returncode == 0, exported.stderr
        records = [json.loads(line) for line in layout.iteration(iteration).aggregate("eval").read_text().splitlines()]
        assert {r["policy"] for r in records} == {str(layout.checkpoint(policy))}
        merged, base = _max_error(records, _forward_logprobs(out, records)), _max_error(records, _forward_logprobs(demo_data / "model", records))
        assert merged < 2e-3, f"iteration {iteration}: vLLM's logprobs differ from adapter {policy} merged by {merged}"
        assert base > 20 * max(merged, 1e-4), f"iteration {iteration}: as close to the base ({base}) as to adapter {policy} ({merged})"
