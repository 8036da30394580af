"""The RL loop for real on the demo: engine processes, HTTP rollout, rewards, a
torch.distributed GRPO step across ranks, checkpoints served by every engine (issue 3)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from orchestrator import checkpoints
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.checkpoints import optimizer_state, sums
from orchestrator.phase_table import Phase
from tests.harness import (NODE_TIMEOUT_S, aggregate_records, file_sha256, heartbeat, hold_after_first_batch, kill_tree, rebuilt_sum, rl_flags,
                           run_local, start_ranks, status_json, wait_for, wait_held_mid_rollout)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _served_hashes(log_path):
    """The checksum of the weights each rank's engine loaded, in order, from the engine logs."""
    out = {}
    for log in sorted((log_path / "engines").glob("r*/engine*.log")):
        out[int(log.parent.name[1:])] = re.findall(r"model.safetensors xxh3_128 ([0-9a-f]{32})", log.read_text())
    return out


def test_three_ranks_three_iterations_keep_their_trainers_and_engines_and_every_engine_serves_the_new_checkpoint(demo_data, tmp_path):
    log_path = tmp_path / "run"
    result = run_local(rl_flags(demo_data, log_path, extra=["--max-iterations=3"]))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    layout = RunLayout(log_path)
    # train.keep_alive: one trainer process per worker for the whole attempt, its optimizer continued in memory
    pids = {}
    for events in log_path.glob("attempts/*/events/r*.jsonl"):
        for e in map(json.loads, events.read_text().splitlines()):
            if e["event"] == "timing" and e["part"] == "train.steps":
                pids.setdefault(e["worker"], {})[e["iteration"]] = e["pid"]
    assert sorted(pids) == [0, 1, 2] and all(sorted(p) == [1, 2, 3] and len(set(p.values())) == 1 for p in pids.values()), pids
    for i in (2, 3):
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        # 8 tasks, rl.micro_batch=4, one epoch: 2 optimizer steps per iteration
        assert stats["policy_from"] == "memory" and stats["optimizer_continued_from_step"] == 2 * (i - 1), stats
    # each engine served from one start (ranks on one host may lose a port race first) and took each new checkpoint in place (phase 12 of iterations 1 and 2)
    for log in sorted((log_path / "engines").glob("r*/engine*.log")):
        text = log.read_text()
        assert text.count("listening on") == 1 and len(re.findall(r"reloaded \S+iter-0*[12] in place", text)) == 2, text[-3000:]
    timing = status_json(log_path)["iterations"][0]["timing"]
    assert {"train.startup", "train.steps", "train.checkpoint", "engine.start", "engine.reload"} <= set(timing["parts"]), timing
    for i in (1, 2):
        records = aggregate_records(layout, i)
        assert len(records) == 8 and len({r["task_id"] for r in records}) == 8
        assert sum(len(r["samples"]) for r in records) == 8 * 4  # tasks x samples
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert stats  # the trainer's own account
    # three trainer processes formed one group in each iteration
    for i in (1, 2):
        logs = sorted(log_path.glob("attempts/*/train/trainer-w*.log"))
        assert len(logs) == 3
    # after iteration 1's publish, every engine restarted on the same new weights
    new = rebuilt_sum(layout.checkpoint(1), tmp_path / "scratch")  # the node's copy of the whole first version (each worker wrote a part)
    base = sums.file_sum(demo_data / "model" / "model.safetensors")
    served = _served_hashes(log_path)
    assert sorted(served) == [0, 1, 2]
    for rank, hashes in served.items():
        assert hashes[0] == base and new in hashes, f"rank {rank} served {hashes}"
    status = status_json(log_path)
    assert [it["evaluated"] for it in status["iterations"]] == [True, True, True]
    assert all(0.0 <= it["metrics"]["accuracy"] <= 1.0 and "pass_at_k" in it["metrics"] for it in status["iterations"])


def test_a_cpu_run_trains_on_one_node_and_rolls_out_on_another_and_corrects_with_the_engines_logprobs(demo_data, tmp_path):
    """train.nodes=0 rollout.nodes=1: node 0 runs the only train worker and no engine, node 1
    the only engine and no trainer; rl.is_correction=tis weighs each token by the trainer's
    probability over the engine's, which serves the same weights in fp32: ratios of 1."""
    log_path = tmp_path / "run"
    flags = rl_flags(demo_data, log_path, num_nodes=2, weights="auto",
                   extra=["--max-iterations=2", "train.nodes=0", "rollout.nodes=1", "rl.is_correction=tis"])
    result = run_local(flags)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "disaggregated placement: the engines serve on through training" in output and "keep their GPUs" not in output, output[-6000:]
    layout = RunLayout(log_path)
    assert [p.parent.name for p in (log_path / "engines").glob("r*/engine*.log")] == ["r00001"]
    assert [p.name for p in log_path.glob("attempts/*/train/trainer-w*.log")] == ["trainer-w00000.log"]
    for i in (1, 2):
        assert not layout.iteration(i).shard("train", 0).exists() or not layout.iteration(i).shard("train", 0).read_text()
        assert len(aggregate_records(layout, i)) == 8
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert stats["world_size"] == 1 and stats["is_correction"] == "tis"
        assert abs(stats["is_ratio_mean"] - 1) < 1e-3 and stats["is_ratio_max"] < 1.01 and stats["is_capped_fraction"] == 0, stats
    assert all(it["evaluated"] for it in status_json(log_path)["iterations"])


def test_a_pipelined_cpu_run_rolls_out_on_the_checkpoint_one_before_and_corrects_for_it(demo_data, tmp_path):
    """rl.max_staleness=1 on train.nodes=0 rollout.nodes=1: iteration i rolls out on
    checkpoint i-2 while iteration i-1 trains; rl.is_correction defaults to tis, whose
    ratios are 1 where the policy is the trainer's (iteration 1) and not once it lags."""
    log_path = tmp_path / "run"
    flags = rl_flags(demo_data, log_path, num_nodes=2, weights="auto",
                   extra=["--max-iterations=3", "train.nodes=0", "rollout.nodes=1", "rl.max_staleness=1", "checkpoint.keep_last=5"])
    result = run_local(flags)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    layout = RunLayout(log_path)
    for i in (1, 2, 3):
        records = aggregate_records(layout, i)
        assert len(records) == 8 and {r["policy_iteration"] for r in records} == {max(0, i - 2)}
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert stats["is_correction"] == "tis", stats
        lagging = abs(stats["is_ratio_mean"] - 1) > 1e-3 or stats["is_ratio_max"] > 1.01
        assert lagging == (i > 1), stats
    its = status_json(log_path)["iterations"]
    assert [it["staleness"] for it in its] == [[0, 0], [1, 1], [1, 1]]
    assert [it["is_ratio"]["correction"] for it in its] == ["tis"] * 3 and its[2]["is_ratio"]["max"] > 1.01, its
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "staleness" in text and "IS ratio" in text and "no training in flight" in text, text


UPDATE_OPTIONS = {
    "rloo-k2-engine-seq-sum-mask-filter": (
        ["rl.advantage=rloo", "rl.clip_eps_high=0.28", "rl.kl_coef=0.01", "rl.kl_estimator=k2", "rl.old_logprobs=engine",
         "rl.loss_agg=seq_mean_token_sum", "rl.overlong=mask", "rl.filter_groups=true"],
        {"advantage": "rloo", "clip": [0.2, 0.28], "kl_estimator": "k2", "old_logprobs": "engine", "loss_agg": "seq_mean_token_sum",
         "overlong": "mask", "filter_groups": True}),
    "gspo-seq-mean-penalty": (
        ["rl.ratio_level=sequence", "rl.loss_agg=seq_mean_token_mean", "rl.clip_eps_low=0.003", "rl.clip_eps_high=0.004",
         "rl.overlong=penalty", "rl.overlong_buffer=2"],
        {"ratio_level": "sequence", "loss_agg": "seq_mean_token_mean", "clip": [0.003, 0.004], "overlong": "penalty",
         "overlong_buffer": 2}),
}


@pytest.mark.parametrize("name", list(UPDATE_OPTIONS))
def test_the_update_options_away_from_their_defaults_run_two_iterations_on_two_ranks(demo_data, tmp_path, name):
    options, reported = UPDATE_OPTIONS[name]
    log_path = tmp_path / "run"
    result = run_local(rl_flags(demo_data, log_path, num_nodes=2, weights="1,1", extra=["--max-iterations=2", *options]))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    layout = RunLayout(log_path)
    for i in (1, 2):
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        assert {k: stats.get(k) for k in reported} == reported, stats
        if "rl.kl_coef=0.01" in options:
            assert stats["kl"] and all(k is not None for k in stats["kl"]), stats
        assert "overlong_samples" in stats
        rounds = (fsio.read_record(layout.iteration(i).summary).get("resample") or {}).get("rounds", 0)  # rl.filter_groups
        assert len(aggregate_records(layout, i)) == 8 * (rounds + 1)


def test_rollout_only_then_update_only_each_run_alone(demo_data, tmp_path):
    log_path = tmp_path / "run"
    # An update before its rollout is a state the user fixes: exit 2, saying what to run.
    early = run_local(rl_flags(demo_data, tmp_path / "early", num_nodes=2, weights="1,1", rl_phase="update", extra=["--max-iterations=1"]))
    assert early.returncode == 2, early.stdout[-4000:]
    assert "no sealed train aggregate" in early.stdout and "--rollout-split train-only" in early.stdout
    rollout = run_local(rl_flags(demo_data, log_path, num_nodes=2, weights="1,1", rl_phase="rollout",
                            extra=["--rollout-split=train-only", "--max-iterations=1"]))
    assert rollout.returncode == 0, rollout.stdout[-4000:]
    layout = RunLayout(log_path)
    assert len(aggregate_records(layout, 1)) == 8 and not layout.checkpoint(1).exists()

    update = run_local(rl_flags(demo_data, log_path, num_nodes=2, weights="1,1", rl_phase="update", extra=["--max-iterations=1"]))
    assert update.returncode == 0, update.stdout[-4000:]
    assert any(layout.checkpoint(1).glob("model*.safetensors")), "the first version is written whole"
    assert fsio.read_record(layout.current_checkpoint)["iteration"] == 1

    evals = tmp_path / "eval-run"
    result = run_local(rl_flags(demo_data, evals, num_nodes=2, weights="1,1", rl_phase="rollout",
                           extra=["--rollout-split=eval-only", "--max-iterations=1"]))
    assert result.returncode == 0, result.stdout[-4000:]
    it = status_json(evals)["iterations"][0]
    assert it["evaluated"] and "accuracy" in it["metrics"] and it["trajectories"] is None


def test_kill_9_mid_rollout_then_rerun_loses_and_duplicates_nothing(demo_data, tmp_path):
    log_path = tmp_path / "run"
    # 64 tasks: rank 0 (weight 2 of 4) has 32 prompts, 8 in flight at a time in requests of 2 (RL_SMALL's
    # rollout.max_inflight=32 sequences of 4 samples), and is held after its first batch is fsynced. Without work stealing,
    # so its share stays its own (tests/system/test_work_stealing.py kills ranks mid-steal).
    flags = rl_flags(demo_data, log_path, extra=["--max-iterations=1", "rl.train_tasks=64", "coordination.work_stealing=false"])
    procs = start_ranks(flags, 3, env_for=hold_after_first_batch(0))
    try:
        layout = RunLayout(log_path)
        wait_held_mid_rollout(layout, 0)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=10)
        assert [p.wait(timeout=NODE_TIMEOUT_S + 60) for p in procs[1:]] == [3, 3]
        partial = layout.iteration(1).shard("train", 0).read_text().splitlines()
        assert 0 < len(partial) < 32
    finally:
        for p in procs:
            kill_tree(p.pid)
    result = run_local(flags)
    assert result.returncode == 0, result.stdout[-6000:]
    ids = [r["task_id"] for r in aggregate_records(layout, 1)]
    assert len(ids) == 64 and len(set(ids)) == 64
    kept = [json.loads(line)["task_id"] for line in layout.iteration(1).shard("train", 0).read_text().splitlines()]
    assert kept[: len(partial)] == [json.loads(line)["task_id"] for line in partial]


def test_filter_groups_draws_more_prompts_and_a_kill_9_mid_round_records_no_task_twice(demo_data, tmp_path):
    """rl.filter_groups: the rollout draws resample rounds until rl.train_tasks informative
    groups are in hand; every rank is killed with SIGKILL part-way through a round, and the
    rerun finishes it: each drawn task is in the aggregate once, the uninformative groups are
    left out of the update and counted in status."""
    log_path = tmp_path / "run"
    flags = rl_flags(demo_data, log_path, num_nodes=2, weights="1,1",
                   extra=["--max-iterations=2", "rl.filter_groups=true", "rl.max_resample_rounds=3", "rl.train_tasks=16",
                          "rl.samples_per_prompt=2", "coordination.work_stealing=false"])
    procs = start_ranks(flags, 2, env_for={0: {"ORCHESTRATOR_FAULT": f"hold-after-round-batch@1:{int(Phase.ROLLOUT)}"}})
    layout = RunLayout(log_path)
    try:
        wait_for(lambda: (hb := heartbeat(layout, 0)) and hb.get("state") == "held", 180, "rank 0 held in a resample round")
        partial = layout.iteration(1).shard("train-r1", 0).read_text().splitlines()
        assert partial, "rank 0 was held after a durable batch of round 1"
    finally:
        for p in procs:
            kill_tree(p.pid)
    for p in procs:
        p.wait(timeout=30)
    result = run_local(flags)
    assert result.returncode == 0, result.stdout[-6000:]
    for i in (1, 2):
        summary = fsio.read_record(layout.iteration(i).summary)
        drawn = summary["resample"]
        ids = [r["task_id"] for r in aggregate_records(layout, i)]
        assert len(ids) == len(set(ids)) == drawn["tasks"] == 16 * (drawn["rounds"] + 1), (i, drawn, len(ids))
        stats = json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
        informative = sum(1 for r in aggregate_records(layout, i) if len({s["reward"] for s in r["samples"]}) > 1)
        assert drawn["informative"] == informative == stats["records"] - stats["filtered_groups"], (drawn, stats)
    first = fsio.read_record(layout.iteration(1).summary)["resample"]
    assert first["rounds"] >= 1
    kept = layout.iteration(1).shard("train-r1", 0).read_text().splitlines()
    assert kept[: len(partial)] == partial, "the records rank 0 had made durable before the kill are kept"
    its = status_json(log_path)["iterations"]
    assert [it["update"]["filtered_groups"] for it in its] == [json.loads((layout.checkpoint(i) / "train_stats.json").read_text())
                                                               ["filtered_groups"] for i in (1, 2)]
    text = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "filtered" in text and "more round(s)" in text, text


def test_a_pickle_where_a_shard_belongs_is_refused_and_never_unpickled(tmp_path):
    """A shard is parsed as JSON lines, never loaded with pickle: a pickle that would write a
    marker when loaded is refused, naming the file and the rank, and the marker never appears."""
    import pickle

    from orchestrator.data import shards

    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    shard = tmp_path / "r00001.jsonl"
    shard.write_bytes(pickle.dumps(Trap()))
    fsio.write_record(shards.manifest_path(shard), {"count": 1, "bytes": shard.stat().st_size, "sha256": file_sha256(shard)})
    with pytest.raises(shards.ShardError, match=r"rank 1: shard .*r00001.jsonl has an invalid record"):
        shards.merge([("rank 1", shard)], tmp_path / "agg.jsonl")
    shards.manifest_path(shard).unlink()
    with pytest.raises(shards.ShardError, match="torn or invalid line"):
        shards.seal(shard)  # sealing parses JSON lines too
    assert not marker.exists()


def test_debug_mode_uses_the_running_engine_and_never_starts_or_stops_one(demo_data, tmp_path):
    port_file = tmp_path / "engine.port"
    engine = subprocess.Popen([sys.executable, "-m", "orchestrator.engine.server", f"--model={demo_data / 'model'}",
                               "--port=0", f"--port-file={port_file}", "--served-model-name=external"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port = int(wait_for(lambda: port_file.exists() and port_file.read_text().strip(), 60, "the external engine's port"))
        log_path = tmp_path / "run"
        result = run_local(rl_flags(demo_data, log_path, num_nodes=1, weights="1", rl_phase="rollout",
                               extra=["--rollout-split=train-only", "--max-iterations=1", "--debug-mode",
                                      f"rollout.engine_url=http://127.0.0.1:{port}"]))
        assert result.returncode == 0, result.stdout[-4000:]
        assert len(aggregate_records(RunLayout(log_path), 1)) == 8
        assert not (log_path / "engines").exists(), "no engine may be started in debug mode"
        assert engine.poll() is None, "the external engine must be left running"
    finally:
        kill_tree(engine.pid)


def test_a_trainer_that_fails_is_named_with_its_own_error_record_in_the_failure_and_status(demo_data, tmp_path):
    """Iteration 2 trains from a checkpoint whose optimizer state belongs to another model
    (sealed, so only the trainer can notice): the trainer's own exception, not its log's
    tail, is the root cause the rank reports and `status` shows."""
    log_path = tmp_path / "run"
    flags = rl_flags(demo_data, log_path, num_nodes=1, weights="1")
    first = run_local([*flags, "--max-iterations=1"])
    assert first.returncode == 0, first.stdout[-4000:]
    checkpoint = RunLayout(log_path).checkpoint(1)
    save_file({"model.embed_tokens.weight/exp_avg": torch.zeros(3, 3), "model.embed_tokens.weight/exp_avg_sq": torch.zeros(3, 3),
               "model.embed_tokens.weight/step": torch.tensor(1.0)}, optimizer_state.path(checkpoint))
    checkpoints.seal(checkpoint)

    second = run_local([*flags, "--max-iterations=2"])
    assert second.returncode == 1, second.stdout[-4000:]
    assert re.search(r"train worker 0 of rank 0 \(pid \d+\) exited with code 2: BadTrainInput: optimizer state \S+adamw.safetensors has "
                     r"shape \(3, 3\) for model.embed_tokens.weight", second.stdout), second.stdout[-4000:]
    failure = status_json(log_path)["failure"]
    assert failure["rank"] == 0 and failure["iteration"] == 2 and failure["phase"] == "10:train", failure
    child = failure["child"]
    assert child["program"] == "trainer" and child["kind"] == "BadTrainInput" and child["exit_code"] == 2, child
    assert "optimizer_state.py" in child["traceback"] or "worker.py" in child["traceback"], child["traceback"]
    shown = subprocess.run([sys.executable, "-m", "orchestrator", "status", f"--log-path={log_path}"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"})
    assert "raised in the trainer" in shown.stdout, shown.stdout
    assert re.search(r"^    orchestrator\.train\.errors\.BadTrainInput: optimizer state", shown.stdout, re.M), shown.stdout


REWARDS = """
from orchestrator.rewards import exact_match


def first_eval_task_fails(task, completion):
    if task["id"] == "test-000000":
        raise ZeroDivisionError("boom in the reward")
    return exact_match(task, completion)


def always_fails(task, completion):
    return task["no_such_column"]
"""


def test_a_failing_reward_scores_zero_is_counted_and_past_the_limit_fails_the_rank_unwritten(demo_data, tmp_path):
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    # Within the limit: 2 of the 32 eval samples fail (6%, limit 10%); they score 0 and are counted.
    tolerant = tmp_path / "tolerant"
    result = run_local(rl_flags(demo_data, tolerant, num_nodes=1, weights="1", extra=[
        "--max-iterations=1", "rl.reward=user_rewards:first_eval_task_fails", "rl.max_reward_error_fraction=0.1"]), env=env)
    assert result.returncode == 0, result.stdout[-6000:]
    assert "ZeroDivisionError: boom in the reward" in result.stdout  # the first traceback is logged
    errors = status_json(tolerant)["iterations"][0]["reward_errors"]
    assert list(errors) == ["eval"] and errors["eval"]["count"] == 2 and errors["eval"]["samples"] == 32
    assert errors["eval"]["first_task_id"] == "test-000000" and "ZeroDivisionError" in errors["eval"]["first_error"]
    failed = [s for r in aggregate_records(RunLayout(tolerant), 1, "eval") for s in r["samples"] if "reward_error" in s]
    assert len(failed) == 2 and all(s["reward"] == 0.0 for s in failed)

    # Past the limit: the rank fails naming the task, and the failing batch is never written.
    broken = tmp_path / "broken"
    result = run_local(rl_flags(demo_data, broken, num_nodes=1, weights="1", extra=[
        "--max-iterations=1", "rl.reward=user_rewards:always_fails"]), env=env)
    assert result.returncode == 1, result.stdout[-6000:]
    failure = status_json(broken)["failure"]
    assert failure["phase"] == "1:rollout" and "RewardFailed" in failure["error"]
    assert re.search(r"failed on 32 of 32 train samples.*first on task train-\d+: KeyError: 'no_such_column'", failure["error"])
    shard = RunLayout(broken).iteration(1).shard("train", 0)
    assert not shard.exists() or shard.read_text() == ""


def _data_with(demo_data, root, files):
    """A data path with the demo's model and these task files (name -> writer)."""
    import shutil

    shutil.copytree(demo_data / "model", root / "model")
    (root / "tasks").mkdir()
    for name, write in files.items():
        write(root / "tasks" / name)
    return root


def _demo_rows(demo_data, name):
    return [json.loads(line) for line in (demo_data / "tasks" / name).read_text().splitlines()]


def _each_task_once(log_path, iterations, per_iteration):
    layout = RunLayout(log_path)
    for i in iterations:
        ids = [r["task_id"] for r in aggregate_records(layout, i)]
        assert len(ids) == len(set(ids)) == per_iteration
        evals = [r["task_id"] for r in aggregate_records(layout, i, "eval")]
        assert len(evals) == len(set(evals)) == 16


def test_parquet_question_answer_columns_run_on_two_ranks(demo_data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(source):
        def write(path):
            rows = _demo_rows(demo_data, source)
            pq.write_table(pa.table({"question": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}), path)
        return write

    data = _data_with(demo_data, tmp_path / "data", {"train.parquet": parquet("train.jsonl"), "test.parquet": parquet("test.jsonl")})
    log_path = tmp_path / "run"
    result = run_local(rl_flags(data, log_path, num_nodes=2, weights="1,1", extra=[
        "--max-iterations=2", "data.train_file=tasks/train.parquet", "data.test_file=tasks/test.parquet", "data.prompt_key=question",
        'rl.stop=["9"]', "rl.max_prompt_tokens=6"]))
    assert result.returncode == 0, result.stdout[-6000:]
    _each_task_once(log_path, (1, 2), 8)
    records = aggregate_records(RunLayout(log_path), 1) + aggregate_records(RunLayout(log_path), 2)
    assert records[0]["task_id"].isdigit() and re.fullmatch(r"\d+\+\d+=", records[0]["prompt"])  # row numbers as ids
    samples = [s for r in records for s in r["samples"]]
    assert all("9" not in s["text"] for s in samples)  # rl.stop reached the engine: it ends a sample, cut from the text
    # Token-exact records: the engine's prompt ids (<s> and one id per character) and each sample's sampled ids.
    assert all(len(r["prompt_token_ids"]) == len(r["prompt"]) + 1 for r in records)
    assert all(s["token_ids"] and len(s["token_ids"]) == len(s["logprobs"]) for s in samples)
    # rl.max_prompt_tokens=6: "12+34=" is 7 tokens with <s>, left out and counted in every iteration's summary
    assert all(len(r["prompt_token_ids"]) <= 6 for r in records)
    too_long = {split: sum(len(r["prompt"]) + 1 > 6 for r in _demo_rows(demo_data, f"{name}.jsonl"))
                for split, name in (("train", "train"), ("eval", "test"))}
    assert all(too_long.values())
    assert [it["prompts_too_long"] for it in status_json(log_path)["iterations"]] == [too_long, too_long]
    assert f"{too_long['train']} of 2000 train tasks are left out: their prompt is longer than 6 tokens" in result.stdout


def test_chat_messages_run_on_two_ranks_through_the_chat_template(chat_demo_data, tmp_path):
    """The chat demo's tasks under a `messages` column: rendered by its ChatML template, sampled
    by its Qwen2 model with a BPE tokenizer, trained on the sampled ids."""
    def chat(source):
        def write(path):
            rows = [{"id": r["id"], "messages": r["prompt"], "answer": r["answer"]} for r in _demo_rows(chat_demo_data, source)]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return write

    files = {"train_chat.jsonl": chat("train.jsonl"), "test_chat.jsonl": chat("test.jsonl")}
    data = _data_with(chat_demo_data, tmp_path / "data", files)
    log_path = tmp_path / "run"
    result = run_local(rl_flags(data, log_path, num_nodes=2, weights="1,1", extra=[
        "--max-iterations=2", "data.train_file=tasks/train_chat.jsonl", "data.test_file=tasks/test_chat.jsonl",
        "data.prompt_key=messages", "rl.reward=orchestrator.rewards:math"]))
    assert result.returncode == 0, result.stdout[-6000:]
    _each_task_once(log_path, (1, 2), 8)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from orchestrator.demo import chat_tokenizer

    base = AutoTokenizer.from_pretrained(chat_demo_data / "model")
    record = aggregate_records(RunLayout(log_path), 1)[0]
    assert re.fullmatch(r"<\|im_start\|>user\nWhat is \d+\+\d+\? .*<\|im_end\|>\n<\|im_start\|>assistant\n", record["prompt"], re.S)
    assert record["prompt_token_ids"] == base(record["prompt"])["input_ids"]
    assert all(s["token_ids"] and len(s["token_ids"]) == len(s["logprobs"]) for s in record["samples"])
    checkpoint = RunLayout(log_path).checkpoint(2)  # what the trainer wrote keeps the template and generation config
    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == chat_tokenizer.CHAT_TEMPLATE
    assert GenerationConfig.from_pretrained(checkpoint).eos_token_id == GenerationConfig.from_pretrained(chat_demo_data / "model").eos_token_id
    weights = checkpoint if any(checkpoint.glob("model*.safetensors")) else checkpoint / "master"  # a delta: its fp32 master
    model = AutoModelForCausalLM.from_pretrained(weights, config=AutoConfig.from_pretrained(checkpoint),
                                                 generation_config=GenerationConfig.from_pretrained(checkpoint))
    assert model.config.model_type == "qwen2"
