"""The update's tokens a second, sequences packed (``train.packing=true``) against padded, and
how evenly two train workers share a long-tailed step, in one run.

    python bench/train_tokens.py                          # all three workloads (about 15 minutes on 2 cores)
    python bench/train_tokens.py --only longtail --groups 4

Workloads, each trained by the real trainer (``orchestrator.train.worker --serve``, one
worker, ``OMP_NUM_THREADS`` = every core) on the same aggregate, once padded and once packed:

- ``chat``: the chat demo's rollouts: ``demo-data --chat`` (its warm start), then one
  iteration rolled out by ``orchestrator run --rl-phase rollout`` at the README's settings;
- ``longtail``: a long-tailed length distribution on a locally made Qwen2 of about 150M
  parameters (bench/publish.py's ``qwen150m``, random init): prompts of 64-256 tokens,
  completions geometric with mean 200, at most 1,024; ``--groups`` groups of 4 samples;
- ``tools``: the tool demo's multi-turn samples (``demo-data --tools``, one iteration rolled
  out at the README's settings): observations in the sample, out of the loss.

Per workload and layout: the padding share of the update's forward passes (the trainer's
``padding_share``), the seconds of the log-prob pass (``timing.prepare``) and of the optimizer
steps (``timing.steps``), and the update's tokens a second: the samples' real tokens (prompt
and completion) over the steps' seconds. ``rl.epochs=1``, ``train.micro_batch_tokens`` the
default, the learning rate 1e-6.

Balance (``longtail``): the step's samples shared between two workers as the plan deals
them (by tokens) and as it used to (record k to worker k mod 2); each share's forward and
backward timed alone on this machine, one after the other: the slowest share's seconds
over the fastest's.

Writes JSON (default bench/results/train_tokens.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, geometric_length, machine, python_env, table, write_json  # noqa: E402
from bench.publish import Trainer, make_model  # noqa: E402
from orchestrator.protocol.layout import RunLayout  # noqa: E402
from orchestrator.train import request  # noqa: E402

WORKLOADS = ("chat", "longtail", "tools")
ROLLOUT = {  # the README's commands, one iteration rolled out
    "chat": ["--chat"],
    "tools": ["--tools"],
}
ROLLOUT_FLAGS = {"chat": [], "tools": ["rl.max_tokens=64", "rl.max_turns=3"]}


# -- inputs --------------------------------------------------------------------------------------

def demo_rollouts(kind: str, work: Path, seed: int) -> tuple[Path, Path]:
    """(model, train aggregate) of one iteration of the chat or tool demo, rolled out."""
    data, log_path = work / f"{kind}-data", work / f"{kind}-run"
    console.print(f"{kind}: making the demo and rolling out one iteration ...")
    subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", *ROLLOUT[kind], f"--data-path={data}", f"--seed={seed}"],
                   check=True, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = subprocess.run([sys.executable, "-m", "orchestrator", "run", f"--data-path={data}", f"--log-path={log_path}",
                           "--rl-phase=rollout", "--rollout-split=train-only", "--max-iterations=1", "--eval-interval=100", *ROLLOUT_FLAGS[kind]],
                          env=python_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise BenchError(f"{kind}: the rollout exited {done.returncode}:\n{done.stderr[-2000:]}")
    return data / "model", RunLayout(log_path).iteration(1).aggregate("train")


def long_tail_aggregate(path: Path, *, groups: int, vocab: tuple[int, int], seed: int) -> None:
    """``groups`` groups of 4 samples: prompts of 64-256 random ids, completions geometric with
    mean 200 (at most 1,024), random rewards and engine log-probs."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for k in range(groups):
            prompt = [rng.randrange(*vocab) for _ in range(rng.randint(64, 256))]
            samples = []
            for _ in range(4):
                n = geometric_length(rng, 200, 1024)
                samples.append({"text": "", "token_ids": [rng.randrange(*vocab) for _ in range(n)], "reward": rng.random(),
                                "logprobs": [-rng.random() * 3 for _ in range(n)], "finish_reason": "stop" if n < 1024 else "length"})
            f.write(json.dumps({"task_id": f"train-{k:06d}", "prompt": "", "prompt_token_ids": prompt, "samples": samples}) + "\n")


def lengths_of(aggregate: Path) -> list[list[int]]:
    """Per record, per sample: prompt + completion tokens."""
    out = []
    for line in aggregate.read_text().splitlines():
        record = json.loads(line)
        out.append([len(record["prompt_token_ids"]) + len(s["token_ids"]) for s in record["samples"]])
    return out


# -- one update ----------------------------------------------------------------------------------

def update(name: str, model: Path, aggregate: Path, packing: bool, work: Path, args) -> dict:
    """One update by a fresh trainer; the figures of its ``done`` record."""
    groups = len(aggregate.read_text().splitlines())
    trainer = Trainer(work, f"{name}-{'packed' if packing else 'padded'}", threads=os.cpu_count() or 1, timeout_s=args.timeout)
    try:
        done = trainer.update(request.of(iteration=1, data=str(aggregate), init_checkpoint=str(model), reference_checkpoint=None,
                                         output=str(work / f"{trainer.name}-out"), seed=1, lr=1e-6, epochs=1,
                                         micro_batch=max(1, groups // args.steps), packing=packing, write_state=False))
    finally:
        trainer.close()
    stats, timing = done["stats"], done["timing"]
    real = sum(map(sum, lengths_of(aggregate)))
    return {"packing": packing, "padding_share": stats["padding_share"], "real_tokens": real, "steps": len(stats["loss"]),
            "logprob_pass_s": timing["prepare"], "steps_s": timing["steps"], "tokens_per_s": round(real / timing["steps"], 1),
            "logprob_tokens_per_s": round(real / timing["prepare"], 1), "loss": stats["loss"][-1]}


# -- balance -------------------------------------------------------------------------------------

def balance(model: Path, aggregate: Path, args) -> dict:
    """Each of two workers' shares of one step (all the aggregate's samples), dealt by tokens
    and by record index, timed alone: forward and backward of its packed micro-batches."""
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrator.train import grpo, plan

    torch.set_num_threads(os.cpu_count() or 1)
    records = grpo.read_records(aggregate)
    completions = [grpo.encode_record(None, r) for r in records]
    rows = [[len(c.prompt_ids) + len(c.completion_ids) for c in group] for group in completions]
    keys = [(k, s) for k in range(len(rows)) for s in range(len(rows[k]))]
    width = max(map(max, rows))
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    shares = {"by tokens": plan.deal(keys, rows, 2), "by record index": [[key for key in keys if key[0] % 2 == w] for w in range(2)]}
    out = {}
    for how, parts in shares.items():
        seconds = []
        for part in parts:
            started = time.perf_counter()
            for micro_batch in plan.micro_batches(part, rows, args.budget, True, width):
                batch = grpo.collate_rows([[completions[k][s] for k, s in row] for row in micro_batch], 0)
                grpo.completion_logprobs(net, batch, head_at_targets=True).sum().backward()
            seconds.append(round(time.perf_counter() - started, 3))
        tokens = [sum(rows[k][s] for k, s in part) for part in parts]
        out[how] = {"tokens": tokens, "seconds": seconds, "slowest_over_fastest": round(max(seconds) / min(seconds), 3)}
        console.print(f"balance {how}: tokens {tokens}, seconds {seconds}")
    return out


# -- main ----------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=WORKLOADS, action="append", help="this workload only (repeatable)")
    parser.add_argument("--groups", type=int, default=8, help="longtail: groups of 4 samples (default 8: 32 sequences)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps the update is cut into (default 2)")
    parser.add_argument("--budget", type=int, default=16384, help="train.micro_batch_tokens of the balance measure (default 16384)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one update may take")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=RESULTS / "train_tokens.json")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-train-tokens-"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "workloads": {}}
    try:
        for kind in args.only or WORKLOADS:
            if kind == "longtail":
                model = make_model("qwen150m", work, None, args.seed)
                config = json.loads((model / "config.json").read_text())
                config["max_position_embeddings"] = 2048
                (model / "config.json").write_text(json.dumps(config))
                aggregate = work / "longtail.jsonl"
                long_tail_aggregate(aggregate, groups=args.groups, vocab=(10, config["vocab_size"]), seed=args.seed)
            else:
                model, aggregate = demo_rollouts(kind, work, args.seed)
            runs = [update(kind, model, aggregate, packing, work, args) for packing in (False, True)]
            entry = {"runs": runs, "speedup": round(runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"], 3),
                     "logprob_speedup": round(runs[1]["logprob_tokens_per_s"] / runs[0]["logprob_tokens_per_s"], 3)}
            if kind == "longtail":
                entry["balance"] = balance(model, aggregate, args)
            result["workloads"][kind] = entry
            console.print(f"{kind}: packed/padded update tokens/s {entry['speedup']}x")
    except BenchError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    rows = [[kind, "packed" if r["packing"] else "padded", f"{r['padding_share']:.1%}", r["real_tokens"], r["logprob_pass_s"], r["steps_s"],
             r["tokens_per_s"], f"{e['speedup']}x" if r["packing"] else ""]
            for kind, e in result["workloads"].items() for r in e["runs"]]
    table("update tokens/s, packed against padded", ["workload", "layout", "padding", "tokens", "log-prob pass s", "steps s", "tokens/s",
                                                     "packed/padded"], rows)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
