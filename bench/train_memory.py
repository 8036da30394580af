"""Peak memory per train worker and seconds per optimizer step: DDP against FSDP2, gloo on CPU.

    python bench/train_memory.py                           # ~103M-parameter Llama, 1, 2 and 3 workers (~5 min on 2 cores)
    python bench/train_memory.py --data-path /tmp/demo     # take the tokenizer from existing demo data
    python bench/train_memory.py --workers 1,2 --layers 4  # smaller and quicker
    python bench/train_memory.py --lora-rank 16            # the whole model against LoRA: bytes written per update

Makes a Llama-architecture model here (``LlamaConfig``, random init from ``--seed``, no
download: hidden 768, 12 layers of 12 heads, MLP 2048, vocabulary 12,000, untied head;
103.4M parameters, fp32, safetensors) with the demo tokenizer's files beside it (made by
``orchestrator demo-data`` when ``--data-path`` is not given) and its pad, bos and eos ids.
The demo vocabulary has 19 tokens, so the trajectory aggregate carries token ids directly:
``--records`` records of ``--samples`` samples, ``--tokens`` random prompt ids and as many
completion ids each, rewards 0 and 1 alternating within each group (every advantage is
nonzero). Then one update (``epochs=1``, ``--steps`` optimizer steps of ``records / steps``
records, no KL) by ``python -m orchestrator.train.worker`` per configuration: one worker
(the baseline of both strategies: nothing to shard), then DDP and FSDP at each larger
worker count, and last FSDP at the largest count with worker 0 gathering and writing the
whole checkpoint (``parallel_write`` false: the alternative to every worker writing its
shard, measured for the choice in docs/training.md), one process per worker over gloo on
127.0.0.1, each with
``OMP_NUM_THREADS`` = cores // workers (at least 1) and what ``--worker-env`` adds (say, glibc
malloc's settings). Each run writes its checkpoint to a directory of its own, deleted after
the run.

Every figure comes from the workers' ``done`` records, the largest over a run's workers:

- ``memory.parameters_bytes``, ``gradients_bytes``, ``optimizer_bytes`` and their sum
  ``total_bytes``: the worker's own storage of parameters, gradients and AdamW's moments,
  taken after the update's last optimizer step, before the gradients are freed;
- ``memory.peak_rss_bytes``: the process's peak resident set (``ru_maxrss``; activations,
  gathered blocks, DDP's buckets, the loading and the checkpoint write included);
- ``timing.steps`` over the number of steps (``len(stats["loss"])`` of worker 0);
- ``timing.checkpoint``: writing the checkpoint and the optimizer state, to the final barrier;
  and worker 0's own peak resident set, which holds what it gathers.

Ratios: each run's total against DDP's at the same worker count, and each step time
against the one worker's. Checks the issue's line: FSDP's total at 3 workers is at most
0.45x DDP's. The workers share this machine's cores, so step times say how the strategies
compare on one host, not how fast they are on GPUs. Writes JSON (default
bench/results/train_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, demo_data, err_console, kill_tree, machine, python_env, table, wait_for_quiet, write_json  # noqa: E402
from orchestrator.node.ports import free_port  # noqa: E402
from orchestrator.train import request  # noqa: E402

DEFAULT_OUT = RESULTS / "train_memory.json"
STRATEGIES = ("ddp", "fsdp")
MEMORY_KEYS = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "total_bytes", "peak_rss_bytes")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
BOUND = 0.45  # the acceptance line: FSDP's total at 3 workers at most this much of DDP's
MIB = 2**20


# -- inputs --------------------------------------------------------------------------------------

def make_model(directory: Path, *, tokenizer_dir: Path, hidden: int, layers: int, intermediate: int, vocab: int, head_dim: int,
               seed: int) -> int:
    """A random-init Llama from ``seed`` saved to ``directory`` (safetensors) with the
    tokenizer files of ``tokenizer_dir`` and their special ids; returns its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    heads = hidden // head_dim
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, directory / name)
    return sum(p.numel() for p in model.parameters())


def make_aggregate(path: Path, *, records: int, samples: int, tokens: int, vocab: int, seed: int) -> None:
    """``records`` groups of ``samples`` with ``tokens`` prompt and completion ids each (ids
    3..vocab-1: past the demo tokenizer's pad, bos and eos), rewards 0 and 1 alternating."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for k in range(records):
            group = [{"text": "", "token_ids": [rng.randrange(3, vocab) for _ in range(tokens)], "reward": float(i % 2),
                      "finish_reason": "length"} for i in range(samples)]
            record = {"task_id": f"train-{k:06d}", "prompt": "", "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(tokens)],
                      "samples": group}
            f.write(json.dumps(record) + "\n")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- one update ----------------------------------------------------------------------------------

def run_update(work: Path, *, workers: int, strategy: str, model: Path, data: Path, micro_batch: int, timeout_s: float,
               extra_env: dict[str, str], parallel_write: bool = True, lora_rank: int = 0) -> dict:
    """One update by ``workers`` processes; their done records reduced to the largest figures.
    ``parallel_write`` false: with fsdp, worker 0 gathers and writes the whole checkpoint.
    ``lora_rank`` > 0: LoRA adapters of that rank on the default modules (train.lora_rank).
    Raises BenchError (with the failing workers' log tails) when a worker fails or hangs."""
    name = f"{strategy}-{workers}" + ("" if parallel_write else "-gather") + (f"-lora{lora_rank}" if lora_rank else "")
    output = work / name
    config = {"iteration": 1, "data": str(data), "init_checkpoint": str(model), "reference_checkpoint": None, "output": str(output),
              "seed": 1, "lr": 1e-5, "epochs": 1, "micro_batch": micro_batch, "micro_batch_tokens": 0, "clip_eps": 0.2, "kl_coef": 0.0, "max_grad_norm": 1.0,
              "strategy": strategy, "parallel_write": parallel_write}
    if lora_rank:
        config |= {"lora_rank": lora_rank, "base_model": str(model)}
    config_path = work / f"{name}.train.json"
    config_path.write_text(json.dumps(request.of(**config)))
    port, threads = free_port(29600), max(1, (os.cpu_count() or 1) // workers)
    logs = [work / f"{name}.rank{r}.log" for r in range(workers)]
    dones = [work / f"{name}.rank{r}.done.json" for r in range(workers)]
    procs = []
    began = time.monotonic()
    try:
        for rank in range(workers):
            env = {**python_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(workers),
                   "RANK": str(rank), "TRAIN_BACKEND": "gloo", "TRAIN_TIMEOUT_S": "600", "OMP_NUM_THREADS": str(threads), **extra_env}
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "orchestrator.train.worker", "--train-config", str(config_path),
                                               "--done", str(dones[rank])], env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = began + timeout_s
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- rank {r} ---\n{_tail(log)}" for r, log in enumerate(logs))
        raise BenchError(f"{name}: the workers ran past {timeout_s:g} s; their logs end:\n{tails}") from None
    finally:
        for p in procs:
            kill_tree(p, term_grace_s=5)
        shutil.rmtree(output, ignore_errors=True)
    wall = time.monotonic() - began
    if any(codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{_tail(logs[r])}" for r, c in enumerate(codes) if c)
        raise BenchError(f"{name}: worker exit codes {codes}; their logs end:\n{tails}")
    bodies = [json.loads(d.read_text())["body"] for d in dones]
    missing = [r for r, b in enumerate(bodies) if not all(k in (b.get("memory") or {}) for k in MEMORY_KEYS)]
    if missing:
        raise BenchError(f"{name}: the done records of ranks {missing} have no complete 'memory' "
                         f"(this trainer predates train.strategy=fsdp's memory report?): {bodies[missing[0]].get('memory')}")
    steps = len(bodies[0]["stats"]["loss"])
    if steps == 0:
        raise BenchError(f"{name}: the update made no optimizer step")
    return {
        "workers": workers,
        "strategy": strategy,
        "parallel_write": parallel_write,
        "lora_rank": lora_rank,
        "checkpoint_bytes": bodies[0]["stats"]["checkpoint_bytes"],
        "omp_threads": threads,
        "steps": steps,
        "wall_s": round(wall, 2),
        **{key: max(b["memory"][key] for b in bodies) for key in MEMORY_KEYS},
        "step_s": round(max(b["timing"]["steps"] for b in bodies) / steps, 3),
        "checkpoint_s": round(max(b["timing"]["checkpoint"] for b in bodies), 2),
        "worker0_peak_rss_bytes": bodies[0]["memory"]["peak_rss_bytes"],
        "per_worker": [{"rank": r, "memory": b["memory"], "timing": b["timing"]} for r, b in enumerate(bodies)],
        "loss": bodies[0]["stats"]["loss"],
    }


# -- the benchmark -------------------------------------------------------------------------------

def _configurations(counts: list[int], strategies: list[str]) -> list[tuple[int, str, bool]]:
    """(workers, strategy, parallel write): one worker once (DDP's code path; it is both
    strategies' baseline), then every strategy at every larger count; last, FSDP at the
    largest count with worker 0 gathering the whole checkpoint, the alternative to every
    worker writing its shard."""
    out = [(1, "ddp", True)] if 1 in counts else []
    out += [(n, s, True) for n in counts if n > 1 for s in strategies]
    if "fsdp" in strategies and max(counts) > 1:
        out.append((max(counts), "fsdp", False))
    return out


def _ratios(runs: list[dict]) -> None:
    ddp = {r["workers"]: r for r in runs if r["strategy"] == "ddp"}
    parallel = {r["workers"]: r for r in runs if r["strategy"] == "fsdp" and r["parallel_write"]}
    base = ddp.get(1)
    for r in runs:
        same = ddp.get(r["workers"])
        r["total_vs_ddp"] = round(r["total_bytes"] / same["total_bytes"], 4) if same else None
        r["step_vs_one_worker"] = round(r["step_s"] / base["step_s"], 3) if base else None
        shards = parallel.get(r["workers"])
        r["checkpoint_vs_parallel"] = round(r["checkpoint_s"] / shards["checkpoint_s"], 3) if shards and r["strategy"] == "fsdp" else None


def _label(run: dict) -> str:
    if run.get("lora_rank"):
        return f"LoRA rank {run['lora_rank']}"
    if run["workers"] == 1:
        return "one worker (both)"
    return run["strategy"] if run["parallel_write"] else f"{run['strategy']}, worker 0 writes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,3", help="local train worker counts, comma-separated (default 1,2,3)")
    parser.add_argument("--strategies", default="ddp,fsdp", help="train.strategy values at counts above 1 (default ddp,fsdp)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=12000)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--records", type=int, default=12, help="records (groups) in the aggregate")
    parser.add_argument("--samples", type=int, default=4, help="samples per record")
    parser.add_argument("--tokens", type=int, default=32, help="prompt ids and completion ids per sample, each")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of the update (micro_batch = records / steps)")
    parser.add_argument("--seed", type=int, default=0, help="of the model's init and the aggregate")
    parser.add_argument("--data-path", type=Path, help="demo data (orchestrator demo-data) to take the tokenizer from (default: made here)")
    parser.add_argument("--worker-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for every worker (repeatable), e.g. MALLOC_TRIM_THRESHOLD_=0")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    parser.add_argument("--max-load", type=float, help="wait until the 1-minute load average is below this")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="instead: one worker's update of the whole model against LoRA adapters of this rank, the bytes "
                             "each writes (the checkpoint) and holds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.lora_rank < 0:
        parser.error("--lora-rank must be at least 0")
    try:
        counts = sorted({int(w) for w in args.workers.split(",")})
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, not {args.workers!r}")
    strategies = [s for s in args.strategies.split(",") if s]
    if any(n < 1 for n in counts):
        parser.error("--workers counts must be at least 1")
    if not strategies or any(s not in STRATEGIES for s in strategies):
        parser.error(f"--strategies must name some of {', '.join(STRATEGIES)}")
    if args.head_dim < 32 or args.hidden % args.head_dim:
        parser.error(f"--head-dim must be at least 32 and divide --hidden ({args.hidden})")
    if args.records % args.steps:
        parser.error(f"--records ({args.records}) must be a multiple of --steps ({args.steps})")
    if any("=" not in e for e in args.worker_env):
        parser.error("--worker-env takes KEY=VALUE")
    extra_env = dict(e.split("=", 1) for e in args.worker_env)
    if args.vocab <= 3:
        parser.error("--vocab must be above 3 (ids 0-2 are the demo tokenizer's pad, bos and eos)")

    load = wait_for_quiet(args.max_load, max_wait_s=1200)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-train-memory-") as tmp:
        work = Path(tmp)
        data = demo_data(args.data_path, work)
        parameters = make_model(work / "model", tokenizer_dir=data / "model", hidden=args.hidden, layers=args.layers,
                                intermediate=args.intermediate, vocab=args.vocab, head_dim=args.head_dim, seed=args.seed)
        make_aggregate(work / "agg.jsonl", records=args.records, samples=args.samples, tokens=args.tokens, vocab=args.vocab, seed=args.seed)
        console.print(f"model: Llama, {parameters / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, MLP {args.intermediate}, "
                      f"vocabulary {args.vocab}), fp32; {args.records} records x {args.samples} samples of {args.tokens}+{args.tokens} tokens, "
                      f"{args.steps} steps of {args.records // args.steps} records")
        configurations = ([(1, "ddp", True, 0), (1, "ddp", True, args.lora_rank)] if args.lora_rank else
                          [(*c, 0) for c in _configurations(counts, strategies)])
        try:
            for workers, strategy, parallel_write, lora_rank in configurations:
                console.print(f"{_label({'workers': workers, 'strategy': strategy, 'parallel_write': parallel_write, 'lora_rank': lora_rank})} "
                              f"x{workers} ...")
                run = run_update(work, workers=workers, strategy=strategy, model=work / "model", data=work / "agg.jsonl",
                                 micro_batch=args.records // args.steps, timeout_s=args.timeout_s, extra_env=extra_env,
                                 parallel_write=parallel_write, lora_rank=lora_rank)
                console.print(f"  {run['wall_s']:.0f} s; {run['total_bytes'] / MIB:,.0f} MiB params+grads+optimizer, "
                              f"peak RSS {run['peak_rss_bytes'] / MIB:,.0f} MiB, {run['step_s']:.2f} s/step, "
                              f"checkpoint {run['checkpoint_s']:.1f} s", markup=False)
                runs.append(run)
        except BenchError as e:
            err_console.print(f"train_memory: error: {e}", markup=False)
            return 1

    if args.lora_rank:
        return _lora_report(args, runs, load, parameters)
    _ratios(runs)
    table("per worker, the largest over a run's workers (MiB; seconds)",
          ["strategy", "workers", "params", "grads", "optimizer", "total", "total / DDP", "peak RSS", "worker 0 RSS", "s/step",
           "step / 1 worker", "checkpoint s", "ckpt / shards"],
          [[_label(r), r["workers"], *(f"{r[k] / MIB:,.0f}" for k in MEMORY_KEYS[:4]), f"{r['total_vs_ddp']:.3f}",
            f"{r['peak_rss_bytes'] / MIB:,.0f}", f"{r['worker0_peak_rss_bytes'] / MIB:,.0f}", f"{r['step_s']:.2f}",
            f"{r['step_vs_one_worker']:.2f}" if r["step_vs_one_worker"] else None, f"{r['checkpoint_s']:.1f}",
            f"{r['checkpoint_vs_parallel']:.2f}" if r["checkpoint_vs_parallel"] else None]
           for r in runs])
    fsdp3 = next((r for r in runs if r["workers"] == 3 and r["strategy"] == "fsdp" and r["parallel_write"]), None)
    check = fsdp3["total_vs_ddp"] if fsdp3 and fsdp3["total_vs_ddp"] is not None else None
    if check is None:
        console.print("acceptance (FSDP at 3 workers <= 0.45x DDP's params + grads + optimizer per worker): not measured "
                      "(needs --workers with 3 and --strategies ddp,fsdp)")
    else:
        console.print(f"acceptance: FSDP at 3 workers holds {check:.3f}x DDP's parameters + gradients + optimizer state per worker "
                      f"(bound {BOUND}): {'met' if check <= BOUND else 'NOT met'}", markup=False)
    write_json(args.out, {"bench": "train_memory", "machine": machine(), "load_before": load, "parameters": parameters,
                          "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "fsdp3_total_vs_ddp": check, "bound": BOUND, "met": None if check is None else check <= BOUND, "runs": runs})
    return 0


LORA_BOUND = 0.05
"""A LoRA update writes at most this share of the bytes of a whole-model one."""


def _lora_report(args, runs: list[dict], load, parameters: int) -> int:
    full, lora = runs
    ratio = lora["checkpoint_bytes"] / full["checkpoint_bytes"]
    table(f"one update of {parameters / 1e6:.1f}M parameters, one worker: the whole model against LoRA rank {args.lora_rank}",
          ["trained", "checkpoint written (MB)", "vs whole", "optimizer state (MiB)", "params+grads+optimizer (MiB)", "s/step",
           "checkpoint s"],
          [[_label(r) if r["lora_rank"] else "whole model", f"{r['checkpoint_bytes'] / 1e6:,.2f}",
            f"{r['checkpoint_bytes'] / full['checkpoint_bytes']:.4f}", f"{r['optimizer_bytes'] / MIB:,.1f}", f"{r['total_bytes'] / MIB:,.0f}",
            f"{r['step_s']:.2f}", f"{r['checkpoint_s']:.2f}"] for r in runs])
    console.print(f"acceptance: a LoRA update writes {ratio:.4f}x the bytes of a whole-model one (bound {LORA_BOUND}): "
                  f"{'met' if ratio <= LORA_BOUND else 'NOT met'}", markup=False)
    write_json(args.out, {"bench": "train_memory", "mode": "lora", "machine": machine(), "load_before": load, "parameters": parameters,
                          "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "lora_written_vs_full": ratio, "bound": LORA_BOUND, "met": ratio <= LORA_BOUND, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
