"""A model outside --data-path (model.path) and task files in verl's GSM8K Parquet shape,
run for real on two local ranks with the keys docs/data.md ("From verl") gives."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from tests.harness import aggregate_records, rl_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _verl_parquet(demo_rows: list[dict], split: str, path) -> dict[str, str]:
    """The demo's chat tasks as verl's GSM8K preprocessing writes its Parquet; returns
    {index: ground truth} as the run's task ids should carry them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": r["prompt"], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]},
             "extra_info": {"split": split, "index": i, "answer": f"worked out #### {r['answer']}", "question": r["prompt"][-1]["content"]}}
            for i, r in enumerate(demo_rows)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return {str(i): r["answer"] for i, r in enumerate(demo_rows)}


def test_verls_gsm8k_parquet_with_a_model_outside_the_data_path_runs_on_two_ranks(chat_demo_data, tmp_path):
    model = tmp_path / "models" / "chat-demo"
    shutil.copytree(chat_demo_data / "model", model)
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)  # no data/model: the run must take model.path
    truth = {}
    for split, source, name in (("train", "train.jsonl", "train.parquet"), ("eval", "test.jsonl", "test.parquet")):
        demo_rows = [json.loads(line) for line in (chat_demo_data / "tasks" / source).read_text().splitlines()]
        assert isinstance(demo_rows[0]["prompt"], list), "the chat demo's prompts are chat messages"
        truth[split] = _verl_parquet(demo_rows, "test" if split == "eval" else "train", data / "gsm8k" / name)

    log_path = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "local", *rl_flags(data, log_path, num_nodes=2, weights="1,1", max_iterations=2, extra=[
            "rl.eval_tasks=8", f"model.path={model}", "data.train_file=gsm8k/train.parquet", "data.test_file=gsm8k/test.parquet",
            "data.answer_key=reward_model.ground_truth", "data.id_key=extra_info.index", "rl.reward=orchestrator.rewards:math"])],
        capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]

    layout = RunLayout(log_path)
    for iteration in (1, 2):
        for split in ("train", "eval"):
            records = aggregate_records(layout, iteration, split)
            assert records and {r["answer"] for r in records} != {"openai/gsm8k"}
            assert all(r["answer"] == truth[split][r["task_id"]] for r in records), "the id and the answer come from the nested keys"

    [start] = [fsio.read_record(p) for p in sorted((log_path / "attempts").glob("*/start.json"))]
    named = start["fingerprint"]["model"]
    assert named["directory"] == str(model)
    assert named["weights"] == {"model.safetensors": (model / "model.safetensors").stat().st_size}
    # Each rank's engine started on its node's copy of the model outside the data path (publish.delta:
    # the first version's delta applies to it), which each rank copied from there (engines are
    # numbered over the run).
    logs = {log.parent.name: log.read_text(errors="replace") for log in sorted((log_path / "engines").glob("r*/engine*.log"))}
    assert len(logs) == 2 and all(re.search(r"start on \S+/iter-0 as ", text) for text in logs.values()), logs
    assert (result.stdout + result.stderr).count(f"copied from the base model {model}:") == 2, result.stdout[-3000:]
    assert not (data / "model").exists()
