"""How each checkpoint's weights reach the engines: bytes written, bytes an engine node reads
and seconds, today's way (``publish.dtype=fp32``, ``publish.delta=false``,
``checkpoint.state_every=1``) against the new settings (``publish.delta=true``,
``publish.dtype=bf16``, ``checkpoint.state_every=10``, ``publish.full_every=10``), in one run.

    python bench/publish.py --model demo --iterations 3 --lrs 1e-6    # the demo's tiny model: a quick check
    python bench/publish.py --model qwen150m                          # ~150M-parameter Qwen2, 10 iterations at 1e-6 and rl.lr
    python bench/publish.py --model qwen1b --iterations 3 --lrs 1e-6  # ~1B: what scripts/gpu-check.sh runs (on CUDA when there is one)

No RL loop: the real trainer and the node-side rebuild are driven directly. The model is made
here, nothing downloaded: ``demo`` is ``orchestrator demo-data --warm-steps 20``'s (fp32, or
``--data-path``'s), ``qwen150m`` a random-init Qwen2 (``--seed``; hidden 1024, 14 layers of 16
heads, 2 KV heads, MLP 2816, tied embeddings, the chat demo's BPE tokenizer and its
vocabulary) saved in bf16, the dtype its engines serve. Each iteration's train aggregate is
synthetic (``--records`` groups of ``--samples`` samples of random token ids, random rewards,
seeded by the iteration: the same data for every setting and rate).

For each learning rate (``--lrs``) and setting, ONE trainer (``orchestrator.train.worker
--serve``, world size 1) makes ``--iterations`` updates, each continuing from memory; each
checkpoint is written into a staging directory, sealed and renamed into place as the run does
(checkpoints/store.py), and then rebuilt by a node (checkpoints/node_copy.py ``NodeCopies``,
one node-local cache per run). Per iteration:

- bytes written: the checkpoint directory's files, of which state (``optimizer/``,
  ``master/``) and weights (the top-level safetensors: whole, or a delta);
- checkpoint seconds: the trainer's ``timing.checkpoint`` (writing it, to the final barrier);
- engine move: ``NodeCopies.get``'s bytes read and seconds (the baseline has no delta: it
  copies the full version, its weights' bytes); "publish + move" is the two seconds added.
  Today's run serves the baseline's checkpoint in place after one checked read of its weights
  (``manifest.verify(WEIGHTS)``): also timed, ``direct_read_s``, and the ratio against it given.

Replay (new setting): a fresh trainer makes the last iteration N's update again from
checkpoint N-1, which holds no state (only multiples of 10 and the last iteration do), so it
trains N-1's predecessors again from the last state before them (the base model when N <= 10,
``--iterations 10``: iterations 1..9) as the run does (``_replay``, workloads/rl/workload.py).
Reported: its ``timing.replay`` and whether its weights and state are byte-identical to N's.

Everything runs on this machine's disk: the page cache makes reads faster than a shared
filesystem's. Writes JSON (default bench/results/publish.json).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, kill_tree, machine, python_env, table, write_json  # noqa: E402
from orchestrator.checkpoints import files, manifest, node_copy, store  # noqa: E402
from orchestrator.node.ports import free_port  # noqa: E402
from orchestrator.protocol import fsio  # noqa: E402
from orchestrator.protocol.layout import RunLayout  # noqa: E402
from orchestrator.train import request  # noqa: E402
from orchestrator.train.settings import UpdateSettings  # noqa: E402

SETTINGS = {
    "baseline": {"publish_dtype": "float32", "publish_delta": False, "state_every": 1, "full_every": 10},
    "new": {"publish_dtype": "bfloat16", "publish_delta": True, "state_every": 10, "full_every": 10},
}
STATE_DIRS = ("optimizer", files.MASTER_DIR)
SHAPES = {
    "qwen150m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=14, num_attention_heads=16, num_key_value_heads=2,
                     max_window_layers=14),
    "qwen1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=2,
                   max_window_layers=22),
}
"""--model's Qwen2 shapes: with the chat demo's vocabulary, about 150M and 1B parameters."""


# -- inputs --------------------------------------------------------------------------------------

def make_model(kind: str, work: Path, data_path: Path | None, seed: int) -> Path:
    """The model directory: the demo's (made with 20 warm steps unless ``data_path`` has it),
    or a random-init Qwen2 of a shape in SHAPES, in bf16, with the chat demo's tokenizer."""
    if kind == "demo":
        if data_path is None:
            data_path = work / "demo"
            subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={data_path}", "--warm-steps=20"],
                           check=True, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return data_path / "model"
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from orchestrator.demo import chat_tokenizer, tasks, warm_start

    hf_logging.disable_progress_bar()
    tokenizer = chat_tokenizer.fast(chat_tokenizer.corpus(tasks.make_tasks(seed, chat=True)["train"], warm_start.CHAT.target))
    vocab = tokenizer.get_vocab()
    config = Qwen2Config(vocab_size=len(vocab), max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=vocab[chat_tokenizer.EOS], pad_token_id=vocab[chat_tokenizer.PAD], dtype="bfloat16", **SHAPES[kind])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=[vocab[chat_tokenizer.IM_END], vocab[chat_tokenizer.ENDOFTEXT]],
                                               pad_token_id=vocab[chat_tokenizer.PAD])
    directory = work / kind
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def parameters(model: Path) -> int:
    """The parameters saved in ``model``'s safetensors (tied ones once)."""
    import math

    from safetensors import safe_open

    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def write_aggregate(path: Path, *, ids: tuple[int, int], records: int, samples: int, prompt: int, completion: int, seed: int) -> None:
    """A train aggregate (train/grpo.py's records): random ids in ``ids`` (past the special
    tokens), random rewards (every group's vary: no advantage is zero) and engine log-probs."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for k in range(records):
            group = [{"text": "", "token_ids": [rng.randrange(*ids) for _ in range(completion)], "reward": rng.random(),
                      "logprobs": [-rng.random() * 3 for _ in range(completion)], "finish_reason": "length"} for _ in range(samples)]
            f.write(json.dumps({"task_id": f"train-{k:06d}", "prompt": "", "prompt_token_ids": [rng.randrange(*ids) for _ in range(prompt)],
                                "samples": group}) + "\n")


# -- the trainer ---------------------------------------------------------------------------------

class Trainer:
    """One ``--serve`` trainer process (world size 1), its log in ``work/<name>.log``."""

    def __init__(self, work: Path, name: str, threads: int, timeout_s: float):
        self.work, self.name, self.timeout_s, self.requests = work, name, timeout_s, 0
        self.log = work / f"{name}.log"
        env = {**python_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port(29700)), "WORLD_SIZE": "1", "RANK": "0",
               "OMP_NUM_THREADS": str(threads)}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.train.worker", "--serve"], env=env, stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT)

    def update(self, body: dict) -> dict:
        """One request; its ``done`` record (iteration, timing, stats). Raises BenchError."""
        self.requests += 1
        config, done = self.work / f"{self.name}.{self.requests}.json", self.work / f"{self.name}.{self.requests}.done.json"
        config.write_text(json.dumps(body))
        with contextlib.suppress(OSError):  # a trainer that died: said below
            self.proc.stdin.write((json.dumps({"config": str(config), "done": str(done)}) + "\n").encode())
            self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout_s
        while (answer := fsio.read_record(done)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                how = "ran past the timeout" if self.proc.returncode is None else f"exited with {self.proc.returncode}"
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
                raise BenchError(f"{self.name}: the trainer {how}; its log ends:\n{tail}")
            time.sleep(0.05)
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # the end of stdin ends a serving trainer
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc, term_grace_s=5)


def _request(layout: RunLayout, model: Path, i: int, init: int, output: Path, setting: dict, lr: float, args, write_state: bool) -> dict:
    """The train request of iteration ``i`` from checkpoint ``init`` (0: the base model), as the run writes it."""
    return request.of(iteration=i, data=str(layout.iteration(i).aggregate("train")), init_checkpoint=str(layout.checkpoint(init) if init else model),
                      init_iteration=init or None, reference_checkpoint=None, output=str(output), seed=args.seed + i,
                      publish_dtype=setting["publish_dtype"], publish_delta=setting["publish_delta"], publish_full_every=setting["full_every"],
                      write_state=write_state, lr=lr, max_tokens=args.completion_tokens)


# -- one setting at one rate ---------------------------------------------------------------------

def _bytes(directory: Path) -> dict:
    every = [p for p in directory.rglob("*") if p.is_file()]
    state = sum(p.stat().st_size for p in every if p.relative_to(directory).parts[0] in STATE_DIRS)
    return {"written_bytes": sum(p.stat().st_size for p in every), "state_bytes": state, "weights_bytes": files.weight_bytes(directory)}


def run(name: str, setting: dict, lr: float, model: Path, work: Path, args, ids: tuple[int, int]) -> dict:
    """``args.iterations`` updates by one trainer, each checkpoint placed and rebuilt on a
    node; with the new setting, the last one replayed by a fresh trainer. The run's directory
    goes afterwards."""
    root = work / f"{name}-lr{lr:g}"
    layout = RunLayout(root / "run")
    for i in range(1, args.iterations + 1):
        write_aggregate(layout.iteration(i).aggregate("train"), ids=ids, records=args.records, samples=args.samples,
                        prompt=args.prompt_tokens, completion=args.completion_tokens, seed=args.seed + i)
    copies = node_copy.NodeCopies(layout, root / "cache")
    if setting["publish_delta"]:  # as the run does: the engines start on the base model, copied into the node's directory
        copies.get(store.Checkpoint(model, 0))  # read once at the start, as today's engines read it: not counted
    trainer = Trainer(root, "trainer", args.threads, args.timeout)
    rows = []
    try:
        for i in range(1, args.iterations + 1):
            state = i % setting["state_every"] == 0 or i == args.iterations
            staging = store.new_staging(layout, i, "bench", 0)
            done = trainer.update(_request(layout, model, i, i - 1, staging, setting, lr, args, state))
            began = time.monotonic()
            path = store.place(layout, i, staging)
            place_s = time.monotonic() - began
            copies.get(store.Checkpoint(path, i))
            stats, timing, built = done["stats"], done["timing"], copies.last
            row = {"iteration": i, "published": stats.get("published"), "state": stats.get("state"), **_bytes(path),
                   "delta_bytes": stats.get("delta_bytes"), "checkpoint_s": timing["checkpoint"], "place_s": round(place_s, 4),
                   "engine_read_bytes": built.bytes_read, "engine_s": built.seconds, "engine_how": built.how,
                   "publish_move_s": round(timing["checkpoint"] + built.seconds, 4), "update_s": timing["steps"], "loss": stats["loss"][-1]}
            if not setting["publish_delta"]:  # today's rank: one checked read of the weights, then the engines load them in place
                began = time.monotonic()
                manifest.verify(path, manifest.WEIGHTS)
                row["direct_read_s"] = round(time.monotonic() - began, 4)
                if i > 1:  # nothing reads it again (the trainer holds it, the node too): bounds the disk used at 150M
                    shutil.rmtree(layout.checkpoint(i - 1))
            rows.append(row)
            console.print(f"{name} lr {lr:g} iteration {i}: {row['published']}, {row['written_bytes'] / 1e6:.2f} MB written, "
                          f"{row['engine_read_bytes'] / 1e6:.2f} MB read ({built.how}), {row['publish_move_s']:.3f} s", markup=False)
    finally:
        trainer.close()
        copies.close()
    result = {"iterations": rows, "mean": {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k.endswith(("_bytes", "_s"))
                                            and all(isinstance(r[k], (int, float)) for r in rows)}}
    if setting["publish_delta"]:
        result["replay"] = replay(layout, model, root, setting, lr, args)
    shutil.rmtree(root, ignore_errors=True)
    return result


def _sums(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*.safetensors"))}


def replay(layout: RunLayout, model: Path, root: Path, setting: dict, lr: float, args) -> dict | None:
    """The last iteration N made again by a fresh trainer from N-1, which holds no state: it
    replays the iterations from the last state before it first. None: nothing to replay."""
    last, init = args.iterations, args.iterations - 1
    if init < 1 or files.has_state(layout.checkpoint(init)):
        return None
    start = init - 1
    while start > 0 and not files.has_state(layout.checkpoint(start)):
        start -= 1
    body = _request(layout, model, last, init, root / "replayed", setting, lr, args, True)
    steps = [{"iteration": j, "data": str(layout.iteration(j).aggregate("train")), "seed": args.seed + j} for j in range(start + 1, init + 1)]
    body |= {"replay": steps, "replay_from": str(layout.checkpoint(start) if start else model), "replay_from_iteration": start or None}
    trainer = Trainer(root, "replay", args.threads, args.timeout)
    try:
        done = trainer.update(body)
    finally:
        trainer.close()
    timing = done["timing"]
    return {"from": start, "replayed": done["stats"].get("replayed"), "replay_s": timing.get("replay"), "load_s": timing.get("load"),
            "startup_s": timing.get("startup"), "exact": _sums(root / "replayed") == _sums(layout.checkpoint(last))}


# -- the benchmark -------------------------------------------------------------------------------

def _ratio(new: float, old: float) -> float | None:
    return round(new / old, 4) if old else None


def summarize(result: dict) -> dict:
    """Per rate, the new setting's means over the baseline's: what the acceptance asks."""
    out = {}
    for lr, run_ in result["runs"]["new"].items():
        old, new = result["runs"]["baseline"][lr]["mean"], run_["mean"]
        out[lr] = {k: _ratio(new[k], old[k]) for k in ("written_bytes", "engine_read_bytes", "publish_move_s")}
        out[lr]["publish_move_s_vs_direct_read"] = _ratio(new["publish_move_s"], old["checkpoint_s"] + old["direct_read_s"])
    return out


def show(result: dict, args) -> None:
    rows = []
    for lr, ratios in result["summary"].items():
        for name in SETTINGS:
            m = result["runs"][name][lr]["mean"]
            rows.append([lr, name, *(f"{m[k] / 1e6:.3f}" for k in ("written_bytes", "state_bytes", "engine_read_bytes")),
                         *(f"{m[k]:.3f}" for k in ("checkpoint_s", "engine_s", "publish_move_s"))])
        rows.append([lr, "new / baseline", f"{ratios['written_bytes']}x", "", f"{ratios['engine_read_bytes']}x", "", "",
                     f"{ratios['publish_move_s']}x ({ratios['publish_move_s_vs_direct_read']}x of ckpt + direct read)"])
        if (rep := result["runs"]["new"][lr].get("replay")) is not None:
            rows.append([lr, f"replay {rep['replayed']}", "", "", "", "", "", f"{rep['replay_s']:.3f} s, exact: {rep['exact']}"])
    table(f"publish: {args.model} ({result['model']['parameters'] / 1e6:.1f}M parameters), {args.iterations} iterations, means per iteration",
          ["lr", "setting", "written MB", "state MB", "engine read MB", "checkpoint s", "engine s", "publish+move s"], rows, right_from=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo", *SHAPES), default="qwen150m",
                        help="qwen1b: the shape scripts/gpu-check.sh publishes on CUDA")
    parser.add_argument("--data-path", type=Path, default=None, help="with --model demo: existing demo data (default: made here)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-6, UpdateSettings().lr],
                        help="comma-separated learning rates (default: 1e-6 and rl.lr's default)")
    parser.add_argument("--records", type=int, default=8, help="groups per iteration")
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the trainer's OMP_NUM_THREADS")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one update may take")
    parser.add_argument("--dir", type=Path, default=None, help="where to work (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS / "publish.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="publish-", dir=args.dir))
    try:
        from transformers import AutoTokenizer

        model = make_model(args.model, work, args.data_path, args.seed)
        tokenizer = AutoTokenizer.from_pretrained(model)
        ids = (max(tokenizer.all_special_ids) + 1, len(tokenizer))
        result = {"machine": machine(), "model": {"kind": args.model, "parameters": parameters(model)}, "settings": SETTINGS,
                  "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": {n: {} for n in SETTINGS}}
        for lr in args.lrs:
            for name, setting in SETTINGS.items():
                result["runs"][name][f"{lr:g}"] = run(name, setting, lr, model, work, args, ids)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["summary"] = summarize(result)
    show(result, args)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
