"""FSDP2 against DDP, end to end: real trainer processes in a gloo group on 127.0.0.1.

One update of the same init checkpoint on the same aggregate with the same seed gives the
same weights and optimizer state whatever the strategy, the number of train workers and the
micro-batching (train/plan.py normalizes the loss over the whole step), and FSDP writes a
standard sharded checkpoint that transformers loads as it is.

The updates are made by serving groups (``--serve``, as train.keep_alive runs the workers), one
per worker count, kept for the module: one start of each, not one per update; a bad config is
refused by a one-shot worker (``--train-config``).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator import checkpoints
from orchestrator.checkpoints import sums
from orchestrator.demo import model as demo_model
from orchestrator.train import request
from tests.harness import free_port, train_worker_env, wait_for, write_addition_aggregate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
IS_TOLERANCE = 1e-4


def _texts(k: int, total: int) -> list[str]:
    """The 4 samples of the aggregate's task k (12 tasks, with the engine's token ids): rewards
    that differ within most groups, completions of 2 to 12 tokens (so that packed rows hold
    several)."""
    right = str(total)
    return [right + "0" * (3 * (k % 4)), right, str(total + 1), str(total + 10)] if k != 4 else ["1", "2", "3", "4"]


def _request(work: Path, name: str, **overrides) -> Path:
    """The train config of one update, written to ``work``; its checkpoint is ``work / name``."""
    config = {
        "iteration": 1, "data": str(work / "agg.jsonl"), "init_checkpoint": str(work / "init"), "reference_checkpoint": str(work / "ref"),
        "output": str(work / name), "seed": 11, "lr": 1e-3, "epochs": 2, "micro_batch": 6, "clip_eps": 0.2, "kl_coef": 0.05,
        "max_grad_norm": 1.0, **overrides,
    }
    path = work / f"{name}.train.json"
    path.write_text(json.dumps(request.of(**config)))
    return path


class _Group:
    """``world`` train worker processes in one gloo group, serving one update per request
    (``--serve``, as train.keep_alive runs them), kept for the module: every update here loads
    its own init checkpoint (none names an init_iteration, so none is taken from memory), and
    the module's updates pay for a group's start once, not each. Each rank's log is
    ``serve-<world>-r<rank>.log`` under the module's work directory."""

    def __init__(self, work: Path, world: int):
        self.work, self.world = work, world
        port = free_port()
        self.logs = [work / f"serve-{world}-r{rank}.log" for rank in range(world)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with log.open("a") as err:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "orchestrator.train.worker", "--serve"], cwd=REPO,
                                                   env=train_worker_env(world, rank, port, 120), stdin=subprocess.PIPE,
                                                   stdout=subprocess.DEVNULL, stderr=err, text=True))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def update(self, name: str, config: Path) -> None:
        done = [self.work / f"{name}.done-r{rank}.json" for rank in range(self.world)]
        for p, d in zip(self.procs, done):
            p.stdin.write(json.dumps({"config": str(config), "done": str(d)}) + "\n")
            p.stdin.flush()

        def answered() -> bool:
            for rank, p in enumerate(self.procs):
                assert p.poll() is None, f"{name}: rank {rank} exited {p.returncode}:\n{self.logs[rank].read_text()[-3000:]}"
            return all(d.exists() for d in done)

        wait_for(answered, 240, f"{name}: the update by {self.world} workers", interval=0.05)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()  # no more updates: each ends
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _tensors(checkpoint: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the weights (prefix "model") or optimizer state ("optimizer/adamw"),
    whichever layout: one file, or shards and an index."""
    index = checkpoint / f"{prefix}.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [Path(prefix).name + ".safetensors"]
    out = {}
    for f in files:
        out.update(load_file(index.parent / f if index.is_file() else checkpoint / f"{prefix}.safetensors"))
    return out


def _worst_relative_difference(a: dict, b: dict) -> tuple[float, str]:
    assert sorted(a) == sorted(b)
    return max(((x - b[n]).norm().item() / max(x.norm().item(), 1e-12), n) for n, x in a.items() if x.dtype.is_floating_point)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("fsdp")
    demo_model.save(demo_model.create(0), work / "init")
    demo_model.save(demo_model.create(1), work / "ref")  # a reference unlike the policy: the KL term matters
    from transformers import AutoTokenizer

    write_addition_aggregate(work / "agg.jsonl", 12, _texts, tokenizer=AutoTokenizer.from_pretrained(work / "init"))
    return work


@pytest.fixture(scope="module")
def trained(work):
    """Updates by name, each made once for the module: ``trained(name, world, **config)`` is the
    checkpoint of one update by ``world`` workers (a serving group of that size)."""
    made: dict[str, Path] = {}
    groups: dict[int, _Group] = {}

    def train(name: str, world: int, **overrides) -> Path:
        if name not in made:
            if world not in groups or not groups[world].alive():  # a failed update does not fail the next test's
                groups[world] = _Group(work, world)
            groups[world].update(name, _request(work, name, **overrides))
            made[name] = work / name
        return made[name]

    yield train
    for group in groups.values():
        group.close()


@pytest.fixture(scope="module")
def ddp_two(trained) -> Path:
    return trained("ddp-2", 2, strategy="ddp", packing=False)  # the baseline: one sample a row, padded


@pytest.mark.parametrize("world, strategy, budget, micro_batches, checkpointing", [
    (2, "fsdp", 0, 1, False),
    (3, "ddp", 0, 1, False),
    (3, "fsdp", 0, 1, False),
    (3, "fsdp", 24, 4, True),
    (2, "ddp", 24, 4, False),
])
def test_one_update_gives_the_same_weights_and_optimizer_state_whatever_the_strategy_workers_and_micro_batches(
        work, trained, ddp_two, world, strategy, budget, micro_batches, checkpointing):
    other = trained(f"{strategy}-{world}-{budget}{'-ac' * checkpointing}", world, strategy=strategy, micro_batch_tokens=budget,
                    activation_checkpointing=checkpointing, packing=False)
    stats = json.loads((other / "train_stats.json").read_text())
    assert (stats["strategy"], stats["world_size"], stats["activation_checkpointing"]) == (strategy, world, checkpointing)
    assert min(stats["micro_batches"]) >= micro_batches and (budget or max(stats["micro_batches"]) == 1), stats["micro_batches"]
    base = json.loads((ddp_two / "train_stats.json").read_text())
    assert stats["steps_per_epoch"] == base["steps_per_epoch"] == 2 and stats["tokens"] == base["tokens"]
    for prefix in ("model", "optimizer/adamw"):
        worst, name = _worst_relative_difference(_tensors(ddp_two, prefix), _tensors(other, prefix))
        print(f"{strategy} x{world} budget {budget}: {prefix} worst relative difference {worst:.2e} ({name})")
        assert worst <= TOLERANCE, f"{prefix}: {name} differs by {worst:.2e} (relative norm)"
    changed = _tensors(ddp_two, "model")["model.layers.0.mlp.up_proj.weight"] - load_file(work / "init" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert changed.abs().max() > 1e-4, "the update moved nothing: the comparison would prove nothing"


@pytest.mark.parametrize("case", ["ddp-2", "fsdp-3-24", "lora-ddp-2"])
def test_packed_sequences_give_the_same_update_as_padded_ones(work, trained, ddp_two, bf16_bases, case):
    """train.packing=true lays several samples one after another in a row (a block-diagonal
    mask, positions restarting at each); the update is the padded one's. The update options,
    multi-turn masks and the importance correction are compared packed below."""
    if case == "lora-ddp-2":  # one step: Adam's first steps move the zero-initialised B by about the rate whatever the
        # gradient's size, so a float difference in its smallest gradients would grow over several
        one_step = _lora_options(bf16_bases[1], epochs=1, micro_batch=12)
        padded = trained("lora-ddp-2-one-step", 2, strategy="ddp", packing=False, **one_step)
        packed = trained("lora-ddp-2-one-step-packed", 2, strategy="ddp", packing=True, **one_step)
        prefixes = ("adapter_model", "optimizer/adamw")
    else:
        world, strategy, budget = {"ddp-2": (2, "ddp", 0), "fsdp-3-24": (3, "fsdp", 24)}[case]
        padded = ddp_two
        packed = trained(f"{case}-packed", world, strategy=strategy, micro_batch_tokens=budget, packing=True)
        prefixes = ("model", "optimizer/adamw")
    stats, padded_stats = (json.loads((out / "train_stats.json").read_text()) for out in (packed, padded))
    assert stats["packing"] is True and stats["tokens"] == padded_stats["tokens"]
    assert stats["padding_share"] < padded_stats["padding_share"] / 2, (stats["padding_share"], padded_stats["padding_share"])
    if case == "fsdp-3-24":
        assert min(stats["micro_batches"]) >= 2, stats["micro_batches"]
    for prefix in prefixes:
        worst, name = _worst_relative_difference(_tensors(padded, prefix), _tensors(packed, prefix))
        print(f"packed {case}: {prefix} worst relative difference {worst:.2e} ({name})")
        assert worst <= TOLERANCE, f"{prefix}: {name} differs by {worst:.2e} (relative norm)"


def test_fsdp_writes_one_shard_per_worker_and_an_index_that_transformers_loads(work, trained):
    from transformers import AutoModelForCausalLM

    out = trained("fsdp-3-0", 3, strategy="fsdp", micro_batch_tokens=0, activation_checkpointing=False)
    assert not (out / "model.safetensors").exists() and not (out / "optimizer" / "adamw.safetensors").exists()
    for prefix in ("model", "optimizer/adamw"):
        index = json.loads((out / f"{prefix}.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"{Path(prefix).name}-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)], files
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors(out, prefix).values())
    assert not [p.name for p in out.rglob(".*") if p.name != sums.DIRECTORY and sums.DIRECTORY not in p.parts], "temp files left behind"
    loaded = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    weights = _tensors(out, "model")
    assert sorted(loaded.state_dict()) == sorted(weights)
    assert all(torch.equal(t, weights[n]) for n, t in loaded.state_dict().items())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_next_update_continues_a_sharded_optimizer_at_another_worker_count(work, trained, strategy):
    """From the 3-worker FSDP checkpoint, 2 workers of either strategy read their rows of the
    sharded optimizer state and make the same second update."""
    first = trained("fsdp-3-0", 3, strategy="fsdp", micro_batch_tokens=0, activation_checkpointing=False)
    second = trained(f"second-{strategy}-2", 2, strategy=strategy, init_checkpoint=str(first), iteration=2, seed=12)
    stats = json.loads((second / "train_stats.json").read_text())
    assert stats["optimizer_continued_from_step"] == 2 * 2, "2 epochs x 2 steps of the first update"
    if strategy == "fsdp":
        reference = trained("second-ddp-2", 2, strategy="ddp", init_checkpoint=str(first), iteration=2, seed=12)
        for prefix in ("model", "optimizer/adamw"):
            worst, name = _worst_relative_difference(_tensors(reference, prefix), _tensors(second, prefix))
            assert worst <= TOLERANCE, f"{prefix}: {name} differs by {worst:.2e}"
    assert _tensors(second, "optimizer/adamw")["model.norm.weight/step"].item() == 8


def test_bf16_trains_in_both_strategies_close_to_fp32_and_saves_fp32_weights(work, trained, ddp_two):
    base = _tensors(ddp_two, "model")
    for strategy in ("ddp", "fsdp"):
        out = trained(f"{strategy}-2-bf16", 2, strategy=strategy, mixed_precision="bf16")
        weights = _tensors(out, "model")
        assert all(t.dtype == torch.float32 for t in weights.values()), "master weights stay fp32"
        worst, name = _worst_relative_difference(base, weights)
        assert 0 < worst < 1e-2, f"{strategy}: {name} differs from fp32 by {worst:.2e}"


def _with_engine_logprobs(work: Path) -> Path:
    """The aggregate, each sampled token given an engine log-prob that is not the policy's
    (-1, -3, -5 by position), so the importance ratios spread on both sides of the cap."""
    path = work / "agg-logprobs.jsonl"
    if not path.exists():
        lines = []
        for line in (work / "agg.jsonl").read_text().splitlines():
            record = json.loads(line)
            for s in record["samples"]:
                s["logprobs"] = [-1.0 - 2 * (i % 3) for i in range(len(s["token_ids"]))]
            lines.append(json.dumps(record))
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_importance_correction_gives_the_same_update_at_any_worker_count_and_reports_the_ratios(work, trained, ddp_two, mode):
    """Two DDP workers, sequences padded, against three FSDP workers, sequences packed."""
    data = str(_with_engine_logprobs(work))
    two = trained(f"{mode}-ddp-2", 2, strategy="ddp", packing=False, data=data, is_correction=mode, is_cap=2.0)
    three = trained(f"{mode}-fsdp-3-24-packed", 3, strategy="fsdp", micro_batch_tokens=24, packing=True, data=data, is_correction=mode,
                    is_cap=2.0)
    stats = [json.loads((out / "train_stats.json").read_text()) for out in (two, three)]
    for s in stats:
        assert s["is_correction"] == mode and s["is_cap"] == 2.0
        assert 0 < s["is_capped_fraction"] < 1 and s["is_ratio_max"] > 2.0, s  # some tokens past the cap, not all
    for key in ("is_ratio_mean", "is_ratio_max", "is_capped_fraction"):
        assert stats[0][key] == pytest.approx(stats[1][key], rel=1e-5), key
    # The weights carry the float differences of the init log-probs (passes cut otherwise) into
    # every token's loss: measured 1.5e-5 to 4e-5 against 7e-7 without them, and 0.11 between
    # the corrected update and the plain one (below).
    for prefix in ("model", "optimizer/adamw"):
        worst, name = _worst_relative_difference(_tensors(two, prefix), _tensors(three, prefix))
        assert worst <= IS_TOLERANCE, f"{prefix}: {name} differs by {worst:.2e} (relative norm)"
    worst, name = _worst_relative_difference(_tensors(ddp_two, "model"), _tensors(two, "model"))
    assert worst > 1e-4, "the weights changed nothing: the comparison would prove nothing"
    assert "is_ratio_mean" not in json.loads((ddp_two / "train_stats.json").read_text())  # none: no weights, no figures


def test_importance_correction_without_the_engines_logprobs_is_bad_input_naming_the_record(work):
    config = {"iteration": 1, "data": str(work / "agg.jsonl"), "init_checkpoint": str(work / "init"), "reference_checkpoint": None,
              "output": str(work / "no-logprobs"), "seed": 11, "lr": 1e-3, "epochs": 1, "micro_batch": 6, "clip_eps": 0.2,
              "kl_coef": 0.0, "max_grad_norm": 1.0, "is_correction": "tis"}
    path = work / "no-logprobs.train.json"
    path.write_text(json.dumps(request.of(**config)))
    env = train_worker_env(1, 0, free_port(), 60)
    result = subprocess.run([sys.executable, "-m", "orchestrator.train.worker", "--train-config", str(path)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "record t0 sample 0" in result.stderr and "rl.is_correction=none" in result.stderr


def _derived(work: Path, name: str, change) -> Path:
    """The aggregate with engine log-probs, each sample passed through ``change`` (in place)."""
    path = work / name
    if not path.exists():
        records = [json.loads(line) for line in _with_engine_logprobs(work).read_text().splitlines()]
        for record in records:
            for sample in record["samples"]:
                change(sample)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cut(sample: dict) -> None:
    """A completion of 4 tokens or more cut at the length limit (finish_reason "length", no EOS)."""
    if len(sample["token_ids"]) >= 4:
        sample.update(finish_reason="length", token_ids=sample["token_ids"][:-1], logprobs=sample["logprobs"][:-1])


def _observed(sample: dict) -> None:
    """A multi-turn sample: of 3 tokens or more, the second is an environment's observation
    (loss_mask 0, log-prob 0.0)."""
    if len(sample["token_ids"]) >= 3:
        sample["loss_mask"] = [0 if i == 1 else 1 for i in range(len(sample["token_ids"]))]
        sample["logprobs"][1] = 0.0


def _segmented(sample: dict) -> None:
    """An agent's sample whose history was rewritten: of 3 tokens or more, an earlier segment
    of its own prompt (its ids reversed, after a BOS) trained beside it."""
    ids = sample["token_ids"]
    if len(ids) >= 3:
        sample["segments"] = [{"prompt_token_ids": [1, *ids[::-1]], "token_ids": ids[:2], "logprobs": sample["logprobs"][:2],
                               "loss_mask": [1, 1]}]


def _taught(sample: dict) -> None:
    """On-policy distillation: an agent's segmented sample, each token with a teacher's
    log-prob (-2, -0.5 by position) that is not the engine's."""
    _segmented(sample)
    for part in (sample, *sample.get("segments", ())):
        part["teacher_logprobs"] = [-2.0 + 1.5 * (i % 2) for i in range(len(part["token_ids"]))]


OPTIONS = {
    "rloo-k2-clip-higher": {"advantage": "rloo", "kl_estimator": "k2", "clip_eps_high": 0.28},
    "dr-grpo-k1-engine-old": {"advantage": "dr_grpo", "kl_estimator": "k1", "old_logprobs": "engine"},
    "seq-sum-mask-filter": {"loss_agg": "seq_mean_token_sum", "overlong": "mask", "filter_groups": True, "max_tokens": 4},
    "gspo-seq-mean-penalty": {"ratio_level": "sequence", "loss_agg": "seq_mean_token_mean", "clip_eps_low": 0.003, "clip_eps_high": 0.004,
                              "overlong": "penalty", "max_tokens": 4, "overlong_buffer": 2},
    "multi-turn-gspo-tis": {"ratio_level": "sequence", "loss_agg": "seq_mean_token_mean", "is_correction": "tis"},
    "agent-segments-tis": {"is_correction": "tis"},
    "distill-only-agent-segments": {"distill_coef": 0.5, "distill_only": True},
}
UNREPORTED = ("clip_eps_low", "clip_eps_high", "max_tokens")  # "clip" says the first two


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_update_option_gives_the_same_update_at_any_worker_count_packed_or_padded(work, trained, ddp_two, name):
    """Two DDP workers, sequences padded, against three FSDP workers, sequences packed."""
    data = _derived(work, "agg-taught.jsonl", _taught) if "distill" in name else \
        _derived(work, "agg-cut.jsonl", _cut) if "overlong" in OPTIONS[name] else \
        _derived(work, "agg-turns.jsonl", _observed) if "multi-turn" in name else \
        _derived(work, "agg-segments.jsonl", _segmented) if "segments" in name else _with_engine_logprobs(work)
    options = {**OPTIONS[name], "data": str(data)}
    two = trained(f"{name}-ddp-2", 2, strategy="ddp", packing=False, **options)
    three = trained(f"{name}-fsdp-3-24-packed", 3, strategy="fsdp", micro_batch_tokens=24, packing=True, **options)
    stats = json.loads((two / "train_stats.json").read_text())
    reported = {k: v for k, v in OPTIONS[name].items() if k not in UNREPORTED}
    assert {k: stats.get(k) for k in reported} == reported
    if "overlong" in options:
        assert stats["overlong_samples"] > 0, stats
    if options.get("filter_groups"):
        assert stats["filtered_groups"] == 1 and stats["zero_advantage_groups"] == 1, stats  # task t4: every sample wrong
    for prefix in ("model", "optimizer/adamw"):
        worst, where = _worst_relative_difference(_tensors(two, prefix), _tensors(three, prefix))
        print(f"{name} packed fsdp-3 against padded ddp-2: {prefix} worst relative difference {worst:.2e} ({where})")
        assert worst <= IS_TOLERANCE, f"{prefix}: {where} differs by {worst:.2e} (relative norm)"
    worst, where = _worst_relative_difference(_tensors(ddp_two, "model"), _tensors(two, "model"))
    assert worst > 1e-4, "the options changed nothing: the comparison would prove nothing"


def test_a_step_with_no_informative_group_leaves_the_policy_as_it_was(work, trained):
    path = work / "agg-flat.jsonl"
    records = [json.loads(line) for line in (work / "agg.jsonl").read_text().splitlines()]
    for r in records:
        for s in r["samples"]:
            s["reward"] = 1.0
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = trained("flat-filtered", 2, strategy="ddp", data=str(path), filter_groups=True)
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["filtered_groups"] == 12 and stats["steps_per_epoch"] == 0 and stats["loss"] == []
    init = {k: v for k, v in load_file(work / "init" / "model.safetensors").items()}
    worst, where = _worst_relative_difference(init, _tensors(out, "model"))
    assert worst == 0.0, f"{where} moved by {worst:.2e}"


# Master weights: a bf16 base (as every released model is saved) trains in fp32.

SMALL_LR = 1e-5
"""Each of an update's 4 steps moves a weight by about this: under half a bf16 unit in the
last place of nearly every demo weight (|w| ~ 0.02: an ulp of 1.2e-4), so a bf16 master would
round every step away."""


@pytest.fixture(scope="module")
def bf16_bases(work) -> tuple[Path, Path]:
    """The demo model rounded to bf16 and saved so, and the same values saved in fp32."""
    model = demo_model.create(0).to(torch.bfloat16)
    demo_model.save(model, work / "base-bf16")
    demo_model.save(model.float(), work / "base-bf16-as-fp32")
    return work / "base-bf16", work / "base-bf16-as-fp32"


def _master(checkpoint: Path) -> str:
    """Where a checkpoint's fp32 master weights are: master/ when it publishes 16-bit weights."""
    return "master/model" if (checkpoint / "master").is_dir() else "model"


def _delta(checkpoint: Path, base: Path) -> dict[str, torch.Tensor]:
    before = _tensors(base, "model")
    return {n: t - before[n].float() for n, t in _tensors(checkpoint, _master(checkpoint)).items()}


def _lora_options(base: Path, **more) -> dict:
    return {"lora_rank": 8, "base_model": str(base), "init_checkpoint": str(base), "lr": SMALL_LR * 100, **more}


@pytest.mark.parametrize("lora", [False, True], ids=["whole-model", "lora"])
def test_a_bf16_base_trains_with_fp32_master_weights_as_the_same_model_loaded_in_fp32(work, trained, bf16_bases, lora):
    bf16, as_fp32 = bf16_bases
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    options = (lambda base: _lora_options(base)) if lora else (lambda base: {"init_checkpoint": str(base), "lr": SMALL_LR})
    tag = "lora-" if lora else ""
    reference = trained(f"{tag}fp32-of-bf16-ddp-2", 2, strategy="ddp", **options(as_fp32))
    runs = {"ddp-2": trained(f"{tag}bf16-ddp-2", 2, strategy="ddp", **options(bf16)),
            "fsdp-3": trained(f"{tag}bf16-fsdp-3", 3, strategy="fsdp", micro_batch_tokens=24, **options(bf16))}
    weights = "adapter_model" if lora else "master/model"
    for name, out in runs.items():
        stats = json.loads((out / "train_stats.json").read_text())
        assert (stats["master_dtype"], stats["served_dtype"]) == ("float32", "bfloat16"), stats
        assert stats["published_dtype"] == ("float32" if lora else "bfloat16"), stats
        for prefix in (weights, "optimizer/adamw"):
            tensors = _tensors(out, prefix)
            assert {str(t.dtype) for n, t in tensors.items() if not n.endswith("/step")} == {"torch.float32"}, f"{name}: {prefix}"
        if not lora:
            assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16", "the engines serve the base's dtype"
            served, _ = demo_model.load(out)  # as the embedded engine loads a checkpoint
            assert served.dtype == torch.bfloat16
            # publish.dtype=auto: the engines read bf16 weights, the master rounded; half its bytes
            master, published = _tensors(out, "master/model"), _tensors(out, "model")
            assert master.keys() == published.keys()
            assert all(published[n].dtype == torch.bfloat16 and published[n].equal(t.to(torch.bfloat16)) for n, t in master.items())
            master_bytes = sum(p.stat().st_size for p in (out / "master").glob("*.safetensors"))
            assert checkpoints.weight_bytes(out) < 0.51 * master_bytes
        for prefix in (weights, "optimizer/adamw"):
            if lora or prefix != weights:
                worst, where = _worst_relative_difference(_tensors(reference, prefix), _tensors(out, prefix))
            else:  # the master weights barely move at this rate: compare what moved
                worst, where = _worst_relative_difference(_delta(reference, as_fp32), _delta(out, bf16))
            print(f"{tag}bf16 {name}: {prefix} worst relative difference {worst:.2e} ({where})")
            assert worst <= (0.0 if name == "ddp-2" else 1e-3), f"{name}: {prefix} {where} differs from the fp32 model's by {worst:.2e}"
    if lora:
        assert stats["frozen_dtype"] == "float32", "fp32 compute: the frozen base computes in fp32 too"


def test_sub_ulp_updates_accumulate_in_the_fp32_master_across_checkpoints(work, trained, bf16_bases):
    """Each update moves most weights by less than half a bf16 ulp, which a bf16 master would
    round away at every step; the fp32 master keeps it, through the checkpoint, and the next
    update adds to it. The norms' weights (1.0: an ulp of 0.0078) show it whole."""
    bf16, _ = bf16_bases
    first = trained("bf16-ddp-2", 2, strategy="ddp", init_checkpoint=str(bf16), lr=SMALL_LR)
    second = trained("bf16-ddp-2-second", 2, strategy="ddp", init_checkpoint=str(first), iteration=2, seed=12, lr=SMALL_LR)
    assert json.loads((second / "train_stats.json").read_text())["optimizer_continued_from_step"] == 4
    base = {n: t.float() for n, t in _tensors(bf16, "model").items()}
    one, two = _delta(first, bf16), _delta(second, bf16)
    for name, b in base.items():
        half_ulp = torch.finfo(torch.bfloat16).eps * b.abs() / 2
        kept = ((one[name] != 0) & (one[name].abs() < half_ulp)).float().mean().item()
        assert kept > 0.4, f"{name}: {kept:.2f} of the weights moved by a nonzero amount under half a bf16 ulp"
        assert two[name].abs().mean() > 1.5 * one[name].abs().mean(), f"{name}: the second update did not add to the first"
        if name.endswith("norm.weight"):
            assert (one[name] != 0).all() and torch.equal((b + one[name]).to(torch.bfloat16).float(), b), \
                f"{name}: every weight moved, by less than bf16 can hold"


def test_lora_on_a_bf16_base_with_bf16_compute_keeps_the_base_in_bf16_and_the_adapters_in_fp32(work, trained, bf16_bases):
    bf16, as_fp32 = bf16_bases
    out = trained("lora-bf16-fsdp-3-bf16", 3, strategy="fsdp", mixed_precision="bf16", **_lora_options(bf16))
    stats = json.loads((out / "train_stats.json").read_text())
    assert (stats["master_dtype"], stats["frozen_dtype"], stats["served_dtype"]) == ("float32", "bfloat16", "bfloat16"), stats
    for prefix in ("adapter_model", "optimizer/adamw"):
        assert {str(t.dtype) for n, t in _tensors(out, prefix).items() if not n.endswith("/step")} == {"torch.float32"}, prefix
    # Adam's first steps move each weight by about the rate in its gradient's sign, which bf16
    # compute flips for the smallest gradients: the adapters are compared through the loss.
    reference = json.loads((trained("lora-fp32-of-bf16-ddp-2", 2, strategy="ddp", **_lora_options(as_fp32)) / "train_stats.json").read_text())
    assert stats["loss"][0] == pytest.approx(reference["loss"][0], rel=0.02), "the first step computes the same model (B = 0)"
    assert stats["kl"][0] == pytest.approx(reference["kl"][0], rel=0.02)
    assert all(t.abs().max() > 0 for n, t in _tensors(out, "adapter_model").items() if "lora_B" in n), "every adapter trained"
