"""The trainer end to end: real worker processes forming a gloo group over TCP on 127.0.0.1."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from orchestrator.demo import model as demo_model
from orchestrator.train import grpo, request
from tests.harness import free_port, train_worker_env, write_addition_aggregate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
WORLD = 2


def _texts(k: int, total: int) -> list[str]:
    """The 4 samples of the aggregate's task k (9 tasks: uneven shards over 2 ranks): one right.

    Task 4 has no right answer (an all-equal group); task 2's third sample is cut off.
    """
    right, wrong = str(total), [str(total + d) for d in (1, 10, -2)]
    return [wrong[0], right, wrong[1], wrong[2]] if k != 4 else wrong + [wrong[0]]


def _config(work: Path, output: Path, **overrides) -> Path:
    config = {
        "iteration": 1,
        "data": str(work / "agg.jsonl"),
        "init_checkpoint": str(work / "init"),
        "reference_checkpoint": str(work / "ref"),
        "output": str(output),
        "seed": 7,
        "lr": 3e-3,
        "epochs": 2,
        "micro_batch": 4,
        "clip_eps": 0.2,
        "kl_coef": 0.01,
        "max_grad_norm": 1.0,
        **overrides,
    }
    path = output.with_suffix(".train.json")
    path.write_text(json.dumps(request.of(**config)))
    return path


def _launch(config: Path, rank: int, port: int, **env) -> subprocess.Popen:
    environ = {**train_worker_env(WORLD, rank, port, 60), **env}
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.train.worker", "--train-config", str(config)],
        cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _train(work: Path, name: str, **overrides) -> Path:
    output = work / name
    config = _config(work, output, **overrides)
    port = free_port()
    procs = [_launch(config, rank, port) for rank in range(WORLD)]
    results = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{err[-3000:]}"
    return output


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("train")
    demo_model.save(demo_model.create(0), work / "init")
    shutil.copytree(work / "init", work / "ref")  # a distinct path: the reference is loaded on its own
    write_addition_aggregate(work / "agg.jsonl", 9, _texts, cut=(2, 2), logprobs=None)
    return work


@pytest.fixture(scope="module")
def trained(work) -> Path:
    return _train(work, "out-a")


def test_two_ranks_train_and_each_writes_its_part_of_a_complete_checkpoint(work, trained):
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name in ("config.json", *shards, "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "train_stats.json"):
        assert (trained / name).is_file(), name
    sizes = [(trained / name).stat().st_size for name in shards]
    assert max(sizes) < 0.75 * sum(sizes), f"each ddp worker writes about half the weights: {sizes}"
    stats = json.loads((trained / "train_stats.json").read_text())
    # 9 records, 4 per step over both ranks -> 3 steps per epoch, the last of one record
    assert stats["steps_per_epoch"] == 3
    assert len(stats["loss"]) == 2 * 3 and all(isinstance(x, float) for x in stats["loss"])
    assert stats["records"] == 9 and stats["samples"] == 36
    assert stats["mean_reward"] == pytest.approx(8 / 36)
    assert stats["zero_advantage_groups"] == 1
    assert stats["completion_tokens"] > 36 and stats["seconds"] > 0
    assert all(kl is not None and kl >= 0 for kl in stats["kl"])

    init, _ = demo_model.load(work / "init")
    new, tokenizer = demo_model.load(trained)
    assert tokenizer.eos_token_id == 2 and tokenizer("1+2=")["input_ids"][0] == tokenizer.bos_token_id
    changed = [n for n, p in new.state_dict().items() if not torch.equal(p, init.state_dict()[n])]
    assert changed, "the weights did not move"


def test_training_from_a_trained_checkpoint_continues_its_optimizer(work, trained):
    stats = json.loads((trained / "train_stats.json").read_text())
    assert stats["optimizer_continued_from_step"] is None, "the base model has no optimizer state: a fresh one"
    assert (trained / "optimizer" / "adamw.safetensors.index.json").is_file()
    second = _train(work, "out-second", init_checkpoint=str(trained))
    again = json.loads((second / "train_stats.json").read_text())
    assert again["optimizer_continued_from_step"] == 2 * 3, "2 epochs x 3 steps of the first update"


def test_the_same_run_twice_gives_bit_identical_weights(work, trained):
    again = _train(work, "out-b")
    for shard in trained.glob("model-*.safetensors"):
        assert (again / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_training_raises_the_logprob_of_rewarded_completions_relative_to_unrewarded(work, trained):
    def mean_logprob_by_reward(model, tokenizer):
        by_reward = {0.0: [], 1.0: []}
        for record in grpo.read_records(work / "agg.jsonl"):
            completions = grpo.encode_record(tokenizer, record)
            for sample, c in zip(record.samples, completions):
                with torch.no_grad():
                    lp = grpo.completion_logprobs(model, grpo.collate([c], tokenizer.pad_token_id))
                by_reward[sample.reward].append(lp.mean().item())
        return {r: sum(v) / len(v) for r, v in by_reward.items()}

    before = mean_logprob_by_reward(*demo_model.load(work / "init"))
    after = mean_logprob_by_reward(*demo_model.load(trained))
    gain_rewarded, gain_unrewarded = after[1.0] - before[1.0], after[0.0] - before[0.0]
    assert gain_rewarded > 0
    assert gain_rewarded > gain_unrewarded + 0.05, (before, after)


def test_a_rank_whose_peer_never_comes_fails_within_the_timeout_naming_the_rendezvous(work):
    config = _config(work, work / "out-alone")
    started = time.monotonic()
    proc = _launch(config, 0, free_port(), TRAIN_TIMEOUT_S="5")
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert elapsed < 45
    last = err.strip().splitlines()[-1]
    assert "rank 0/2" in last and "rendezvous at tcp://127.0.0.1:" in last, err[-2000:]
    assert not (work / "out-alone").exists()


def test_a_request_without_a_required_key_exits_2_naming_the_key(work):
    config = _config(work, work / "out-bad")
    raw = json.loads(config.read_text())
    del raw["seed"]
    config.write_text(json.dumps(raw))
    proc = _launch(config, 1, free_port())
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "rank 1/2" in err and "lacks seed" in err, err[-2000:]
