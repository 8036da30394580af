"""What a machine with a GPU does with this project, in one command (``scripts/gpu-check.sh``):
the machine, the embedded engine on CUDA against the CPU, one bf16 training step with DDP
and one with FSDP, and the kept-alive trainer's offload and reload around an engine on its GPU.

    bash scripts/gpu-check.sh                             # a CUDA build of torch and a GPU; no network needed
    bash scripts/gpu-check.sh --out /tmp/gpu-check.json --parts machine,engine
    bash scripts/gpu-check.sh --allow-cpu --quick         # every part on the CPU, small sizes: the script's own test

Parts, each on its own (a failing part is printed with its error, and the next one runs):

machine     torch, its CUDA and cuDNN, each GPU's name, memory and compute capability
            (torch.cuda), and nvidia-smi's line per GPU when nvidia-smi is on the PATH
demo        the demo data, made here: ``orchestrator demo-data --warm-steps 20``, and the
            chat demo (``--chat``)
engine      the embedded engine (``python -m orchestrator.engine.server --device cuda``) on
            the main job's prompts, 384 prompts x 8 samples with max_tokens 8 (arith), and
            on the chat demo's with max_tokens 64 (chat): sent as one request, and as
            requests of 16 prompts (the rollout's default at 8 samples; --quick: 1-4) with up to 1024 sequences in flight (the plan and the
            httpx client of bench/engine_batching.py); the best of 2 rounds after a warm-up.
            Completion tokens/s of both, and many's over one's
engine-cpu  the same on ``--device cpu``, one round: the comparison (GPU over CPU, one request)
train       one bf16 optimizer step (``train.mixed_precision=bf16``) of the demo model by one
            train worker on the GPU, with ``train.strategy`` ddp, then ddp padded
            (``train.packing=false``; the others pack), then fsdp, then ddp with
            LoRA adapters of rank 16 (``train.lora_rank``; the checkpoint's bytes too): 48 records of 8
            samples (``train.micro_batch`` 48, the main job's), completions of geometric
            lengths, mean 8 tokens, at most 64 (the padding share of each). The worker runs the
            trainer's own serve loop (``orchestrator.train.serving.serve``, what
            ``train.keep_alive`` runs) for two updates: the first step includes CUDA's
            warm-up, the second is the figure. Peak GPU memory is the worker's
            ``torch.cuda.max_memory_allocated`` over the second update
offload     the kept-alive trainer (ddp, bf16) makes an update; makes another with
            ``train.offload`` (its model and optimizer state moved to host memory); an engine
            on the same GPU serves the arith prompts; and the trainer makes a third update,
            continuing from memory (its state moved back: the reload). Seconds of the offload
            and of the reload; the trainer's GPU memory (allocated, reserved) after each
            update and the device's memory in use at each point
publish     bench/publish.py on a ~1B-parameter Qwen2 shape made here (bf16, random init), 3
            iterations at lr 1e-6, the trainer on the GPU: today's publish (fp32, whole, the
            state every iteration) against bf16 deltas and the state every 10, bytes written
            and read by an engine node and seconds to publish and move, and the replay's
            seconds (--quick: the demo's model, 2 iterations)

Without CUDA (``torch.cuda.is_available()`` false) the check says so in one line and exits
2, unless ``--allow-cpu``: then every part runs on the CPU (the engine's ``--device cpu``,
gloo, and an offload that does nothing, since the trainer moves state off a GPU only), so
that the script's code paths can be tested anywhere. ``--quick`` makes every size small.

Prints a table per part and a summary; writes JSON (default bench/results/gpu_check.json),
the figures of the parts that passed included when another failed. Exit status: 0 every
part passed; 1 some part failed; 2 no CUDA and no ``--allow-cpu``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import engine_batching  # noqa: E402
from bench.common import RESULTS, BenchError, console, err_console, geometric_length, kill_tree, machine, python_env, table, write_json  # noqa: E402
from orchestrator.train import request  # noqa: E402

DEFAULT_OUT = RESULTS / "gpu_check.json"
ENGINE_START_S = 300.0  # loading the model and starting CUDA
UPDATE_S = 900.0  # one trainer update, its process's start included
MIB = 2**20
EXIT_NO_CUDA = 2


@dataclass(frozen=True, slots=True)
class Sizes:
    warm_steps: int
    """demo-data --warm-steps."""
    prompts: int
    n: int
    max_tokens: dict[str, int]
    """Per engine setting (bench/engine_batching.SETTINGS)."""
    max_inflight: int
    """Sequences outstanding in the many-requests mode."""
    request_prompts: tuple[int, int]
    rounds: int
    """Measured rounds of each mode on the GPU (the CPU gets one)."""
    train_records: int
    """Records of the one-step update (train.micro_batch)."""
    train_samples: int
    completion_tokens: int
    """Of each sample in the update's aggregate."""


FULL = Sizes(warm_steps=20, prompts=384, n=8, max_tokens={"arith": 8, "chat": 64}, max_inflight=1024, request_prompts=(16, 16),
             rounds=2, train_records=48, train_samples=8, completion_tokens=8)
QUICK = Sizes(warm_steps=2, prompts=12, n=2, max_tokens={"arith": 4, "chat": 8}, max_inflight=8, request_prompts=(1, 4),
              rounds=1, train_records=4, train_samples=2, completion_tokens=4)


@dataclass(slots=True)
class Check:
    """What the parts share: the options, where they work, the device, and what earlier parts made."""

    sizes: Sizes
    work: Path
    cuda: bool
    engine_dtype: str
    seed: int
    data: dict[str, Path] = field(default_factory=dict)
    """Demo data per engine setting (arith, chat), once the demo part has made it."""
    results: dict[str, dict] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def demo(self, setting: str) -> Path:
        if setting not in self.data:
            raise BenchError(f"no {setting} demo data: the demo part did not make it")
        return self.data[setting]


# -- machine -------------------------------------------------------------------------------------

def part_machine(check: Check) -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
             "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None, "gpus": [], "nvidia_smi": None}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        facts["gpus"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}",
                              "multiprocessors": p.multi_processor_count})
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version,pstate",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise BenchError(f"nvidia-smi exited {out.returncode}: {(out.stderr or out.stdout).strip()[-500:]}")
        facts["nvidia_smi"] = out.stdout.strip().splitlines()
    rows = [["torch", facts["torch"]], ["CUDA (torch built with)", facts["cuda"] or "none: a CPU-only build"],
            ["cuDNN", facts["cudnn"]], ["torch.cuda.is_available()", facts["cuda_available"]]]
    rows += [[f"GPU {g['index']}", f"{g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, compute capability {g['capability']}, "
              f"{g['multiprocessors']} SMs"] for g in facts["gpus"]]
    rows += [["nvidia-smi", line] for line in facts["nvidia_smi"] or ["not on the PATH"]]
    table("machine", ["fact", "value"], rows, right_from=2)
    return facts


# -- demo data -----------------------------------------------------------------------------------

def part_demo(check: Check) -> dict:
    out = {}
    for setting in ("arith", "chat"):
        began = time.monotonic()
        path = check.work / f"{setting}-data"
        argv = [sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}",
                f"--warm-steps={check.sizes.warm_steps}", f"--seed={check.seed}", *engine_batching.SETTINGS[setting].demo_args]
        done = subprocess.run(argv, env=python_env(), capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(argv[1:])} exited {done.returncode}:\n{(done.stderr or done.stdout)[-2000:]}")
        check.data[setting] = path
        out[setting] = {"path": str(path), "seconds": round(time.monotonic() - began, 1)}
    table("demo data", ["setting", "made in s", "path"], [[s, r["seconds"], r["path"]] for s, r in out.items()], right_from=1)
    return out


# -- the engine ----------------------------------------------------------------------------------

class DeviceEngine(engine_batching.Engine):
    """bench/engine_batching.py's engine process, on ``device`` in ``dtype``."""

    def __init__(self, model: Path, work: Path, device: str, dtype: str):
        work.mkdir(parents=True, exist_ok=True)
        self.log_path = work / "engine.log"
        port_file = work / "engine.port"
        port_file.unlink(missing_ok=True)  # a port file left there names an engine gone by now
        argv = [sys.executable, "-m", "orchestrator.engine.server", "--model", str(model), "--port", "0", "--port-file",
                str(port_file), "--served-model-name", engine_batching.NAME, "--device", device, "--dtype", dtype]
        began = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=python_env())
        deadline = began + ENGINE_START_S
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"the engine on {device} did not start (exit code {self.proc.poll()}); its log ends:\n{self.tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.start_s = round(time.monotonic() - began, 2)


def _plan_args(check: Check, rounds: int) -> SimpleNamespace:
    """What bench/engine_batching's rounds read of its command line."""
    s = check.sizes
    return SimpleNamespace(n=s.n, temperature=1.0, seed=check.seed, request_prompts=s.request_prompts, rounds=rounds)


def _engine_setting(check: Check, part: str, setting: str, device: str, rounds: int) -> dict:
    data = check.demo(setting)
    ps = engine_batching.prompts(data, check.sizes.prompts, check.seed)
    max_tokens = check.sizes.max_tokens[setting]
    m = check.sizes.max_inflight
    engine = DeviceEngine(data / "model", check.work / part / setting, device, check.engine_dtype)
    try:
        result = engine_batching.summary(engine_batching.http_rounds(engine, ps, _plan_args(check, rounds), max_tokens, [m]), [m])
    except BenchError as e:
        raise BenchError(f"{setting} on {device}: {e}\nthe engine's log ends:\n{engine.tail()}") from e
    finally:
        engine.stop()
    many = result["many"][m]
    return {"device": device, "dtype": check.engine_dtype, "prompts": len(ps), "n": check.sizes.n, "max_tokens": max_tokens,
            "engine_start_s": engine.start_s, "one_tokens_per_s": result["one_tokens_per_s"], "max_inflight": m,
            "many_tokens_per_s": many["tokens_per_s"], "many_requests": many["requests"], "ratio": many["ratio"],
            "rounds": result["rounds"]}


def _engine_table(title: str, results: dict[str, dict]) -> None:
    table(title, ["setting", "device", "dtype", "prompts x n", "max_tokens", "start s", "one request tok/s", "in flight",
                  "many requests tok/s", "requests", "many / one"],
          [[s, r["device"], r["dtype"], f"{r['prompts']} x {r['n']}", r["max_tokens"], r["engine_start_s"], r["one_tokens_per_s"],
            r["max_inflight"], r["many_tokens_per_s"], r["many_requests"], r["ratio"]] for s, r in results.items()], right_from=3)


def part_engine(check: Check) -> dict:
    out = {s: _engine_setting(check, "engine", s, check.device, check.sizes.rounds) for s in ("arith", "chat")}
    _engine_table(f"embedded engine on {check.device}: completion tokens/s, best of {check.sizes.rounds}", out)
    return out


def part_engine_cpu(check: Check) -> dict:
    gpu = check.results.get("engine")
    if check.device == "cpu" and gpu:  # --allow-cpu without CUDA: the engine part ran on the CPU already
        out = {s: {**r, "same_as_engine_part": True} for s, r in gpu.items()}
        console.print("engine-cpu: no GPU, so the engine part's CPU figures stand for it", markup=False)
    else:
        out = {s: _engine_setting(check, "engine-cpu", s, "cpu", 1) for s in ("arith", "chat")}
    for s, r in out.items():
        r["engine_over_cpu"] = round(gpu[s]["one_tokens_per_s"] / r["one_tokens_per_s"], 2) if gpu else None
    _engine_table("embedded engine on cpu (the comparison): completion tokens/s, one round", out)
    if gpu:
        console.print("engine on " + check.device + " over cpu, one request: "
                      + ", ".join(f"{s} {r['engine_over_cpu']}x" for s, r in out.items()), markup=False)
    return out


# -- the trainer ---------------------------------------------------------------------------------

def trainer_child(notes: str) -> None:
    """The body of a :class:`Trainer` process: the trainer's serve loop
    (``orchestrator.train.serving.serve``, as ``python -m orchestrator.train.worker --serve``
    runs it) over stdin, noting after each update this process's CUDA memory in
    ``notes/<k>.json`` (the worker's own answer has no GPU figure)."""
    import logging

    import torch

    from orchestrator.protocol import fsio
    from orchestrator.train.serving import serve

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")

    def requests():
        for k, line in enumerate(sys.stdin):
            yield line
            # Here serve has answered ``line`` (written its done record) and asks for the next.
            note = {"cuda": torch.cuda.is_available() and torch.cuda.is_initialized()}
            if note["cuda"]:
                note.update(allocated_bytes=torch.cuda.memory_allocated(), peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                            reserved_bytes=torch.cuda.memory_reserved())
                torch.cuda.reset_peak_memory_stats()
            fsio.write_record(Path(notes) / f"{k}.json", note, durable=False)

    code = 0
    try:
        serve(os.environ, requests())
    except Exception:
        logging.getLogger("gpu_check").exception("the trainer failed")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the worker does: c10d's threads must not be torn down under a live group


class Trainer:
    """One train worker (a group of one) serving updates, in a process of its own."""

    def __init__(self, work: Path, cuda: bool):
        from orchestrator.node.ports import free_port

        self.work = work
        self.notes = work / "notes"
        self.notes.mkdir(parents=True)
        self.log_path = work / "trainer.log"
        self.updates = 0
        env = {**python_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port(29700)), "WORLD_SIZE": "1", "RANK": "0",
               "LOCAL_RANK": "0", "TRAIN_BACKEND": "nccl" if cuda else "gloo", "TRAIN_TIMEOUT_S": str(int(UPDATE_S))}
        code = "import sys; from bench.gpu_check import trainer_child; trainer_child(sys.argv[1])"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.notes)], stdin=subprocess.PIPE, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, text=True)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def update(self, **config) -> dict:
        """One update of ``config`` (a train config's keys); returns its done record's body
        with the worker's CUDA memory note as ``cuda``. Raises BenchError with the worker's
        log when it fails or runs past UPDATE_S."""
        from orchestrator.protocol import fsio

        k = self.updates
        self.updates += 1
        path, done, note = self.work / f"update-{k}.train.json", self.work / f"update-{k}.done.json", self.notes / f"{k}.json"
        path.write_text(json.dumps(request.of(**config)))
        try:
            self.proc.stdin.write(json.dumps({"config": str(path), "done": str(done)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise BenchError(f"the trainer exited ({self.proc.poll()}) before update {k}; its log ends:\n{self.tail()}") from None
        deadline = time.monotonic() + UPDATE_S
        while not note.exists():
            if self.proc.poll() is not None:
                raise BenchError(f"the trainer exited {self.proc.returncode} in update {k}; its log ends:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"update {k} ran past {UPDATE_S:g} s; the trainer's log ends:\n{self.tail()}")
            time.sleep(0.05)
        body = fsio.read_record(done)
        if body is None:
            raise BenchError(f"update {k}: no valid done record at {done}")
        return {**body, "cuda": fsio.read_record(note)}

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the end of stdin ends serve
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)


def _aggregate(check: Check, path: Path, *, long_tail: bool = False) -> None:
    """The arith demo's first ``train_records`` prompts, each with ``train_samples`` random
    completions of ``completion_tokens`` ids (past the demo tokenizer's specials), rewards
    alternating: every advantage nonzero. ``long_tail``: completions of geometric lengths
    with that mean instead, at most 8 times it (padding for the padded layout to compute)."""
    from transformers import AutoTokenizer

    data = check.demo("arith")
    s = check.sizes
    tokenizer = AutoTokenizer.from_pretrained(data / "model")
    first = max(tokenizer.all_special_ids) + 1
    rng = random.Random(check.seed)
    with open(path, "w") as f:
        for k, prompt in enumerate(engine_batching.prompts(data, s.train_records, check.seed)):
            lengths = [geometric_length(rng, s.completion_tokens, 8 * s.completion_tokens) if long_tail else s.completion_tokens
                       for _ in range(s.train_samples)]
            samples = [{"text": "", "token_ids": [rng.randrange(first, len(tokenizer)) for _ in range(lengths[i])],
                        "reward": float(i % 2), "finish_reason": "length"} for i in range(s.train_samples)]
            f.write(json.dumps({"task_id": f"train-{k:06d}", "prompt": prompt, "prompt_token_ids": tokenizer(prompt)["input_ids"],
                                "samples": samples}) + "\n")


def _train_config(check: Check, data: Path, output: Path, *, iteration: int, init: Path, init_iteration: int | None,
                  strategy: str, offload: bool = False, lora_base: Path | None = None, packing: bool = True) -> dict:
    """``lora_base``: LoRA adapters (rank LORA_RANK) on that base, ``init`` the base or an adapter."""
    lora = {"lora_rank": LORA_RANK, "base_model": str(lora_base)} if lora_base else {}
    return {"iteration": iteration, "data": str(data), "init_checkpoint": str(init), "init_iteration": init_iteration,
            "reference_checkpoint": None, "output": str(output), "seed": check.seed, "lr": 1e-5, "epochs": 1,
            "micro_batch": check.sizes.train_records, "micro_batch_tokens": 0, "clip_eps": 0.2, "kl_coef": 0.0, "max_grad_norm": 1.0, "strategy": strategy,
            "mixed_precision": "bf16", "offload": offload, "packing": packing, **lora}


LORA_RANK = 16


def _step_s(done: dict) -> float:
    return round(done["timing"]["steps"] / len(done["stats"]["loss"]), 4)


def _mib(value: int | None) -> str | None:
    return None if value is None else f"{value / MIB:,.1f}"


def part_train(check: Check) -> dict:
    work = check.work / "train"
    work.mkdir()
    data = work / "agg.jsonl"
    _aggregate(check, data, long_tail=True)
    model = check.demo("arith") / "model"
    out = {}
    for name, strategy, lora_base, packing in (("ddp", "ddp", None, True), ("ddp, padded", "ddp", None, False), ("fsdp", "fsdp", None, True),
                                               (f"ddp, LoRA r{LORA_RANK}", "ddp", model, True)):
        where = work / name.replace(", ", "-").replace(" ", "")
        trainer = Trainer(where, check.cuda)
        try:
            first = trainer.update(**_train_config(check, data, where / "1", iteration=1, init=model, init_iteration=None,
                                                   strategy=strategy, lora_base=lora_base, packing=packing))
            second = trainer.update(**_train_config(check, data, where / "2", iteration=2, init=where / "1",
                                                    init_iteration=1, strategy=strategy, lora_base=lora_base, packing=packing))
        except BenchError as e:
            raise BenchError(f"{name}: {e}") from e
        finally:
            trainer.close()
        if len(second["stats"]["loss"]) != 1:
            raise BenchError(f"{name}: the update made {len(second['stats']['loss'])} optimizer steps, not one")
        out[name] = {
            "mixed_precision": second["stats"]["mixed_precision"], "records": second["stats"]["records"],
            "samples": second["stats"]["samples"], "tokens": second["stats"]["tokens"][0], "loss": second["stats"]["loss"][0],
            "packing": second["stats"]["packing"], "padding_share": second["stats"]["padding_share"],
            "first_step_s": _step_s(first), "step_s": _step_s(second), "startup_s": round(first["timing"]["startup"], 2),
            "peak_gpu_allocated_bytes": (second["cuda"] or {}).get("peak_allocated_bytes"),
            "gpu_allocated_after_bytes": (second["cuda"] or {}).get("allocated_bytes"),
            "state_bytes": second["memory"]["total_bytes"], "peak_rss_bytes": second["memory"]["peak_rss_bytes"],
            "checkpoint_bytes": second["stats"].get("checkpoint_bytes"),
            "timing": {"first": first["timing"], "second": second["timing"]},
        }
    table(f"one bf16 optimizer step on {check.device}, one train worker (MiB; seconds)",
          ["strategy", "records x samples", "tokens", "padding", "startup s", "first step s", "step s", "peak GPU allocated",
           "GPU allocated after", "params+grads+optimizer", "peak RSS", "checkpoint"],
          [[s, f"{r['records']} x {r['samples'] // r['records']}", r["tokens"], f"{r['padding_share']:.1%}", r["startup_s"], r["first_step_s"], r["step_s"],
            _mib(r["peak_gpu_allocated_bytes"]), _mib(r["gpu_allocated_after_bytes"]), _mib(r["state_bytes"]), _mib(r["peak_rss_bytes"]),
            _mib(r["checkpoint_bytes"])]
           for s, r in out.items()], right_from=1)
    return out


def _device_used_bytes(cuda: bool) -> int | None:
    """Memory in use on GPU 0, every process's (this one's CUDA context included)."""
    if not cuda:
        return None
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return total - free


def part_offload(check: Check) -> dict:
    from orchestrator.engine.client import EngineClient

    work = check.work / "offload"
    work.mkdir()
    data = work / "agg.jsonl"
    _aggregate(check, data)
    arith = check.demo("arith")
    used = {"before the trainer": _device_used_bytes(check.cuda)}
    trainer = Trainer(work / "trainer", check.cuda)
    try:
        trained = trainer.update(**_train_config(check, data, work / "1", iteration=1, init=arith / "model", init_iteration=None,
                                                 strategy="ddp"))
        used["trained"] = _device_used_bytes(check.cuda)
        offloaded = trainer.update(**_train_config(check, data, work / "2", iteration=2, init=work / "1", init_iteration=1,
                                                   strategy="ddp", offload=True))
        used["offloaded"] = _device_used_bytes(check.cuda)
        engine = DeviceEngine(arith / "model", work / "engine", check.device, check.engine_dtype)
        try:
            ps = engine_batching.prompts(arith, check.sizes.prompts, check.seed)
            EngineClient(engine.url, timeout_s=30).wait_healthy(deadline_s=ENGINE_START_S, should_stop=lambda: engine.proc.poll() is not None)
            served = asyncio.run(engine_batching.run_one(engine.url, ps, _plan_args(check, 1), check.sizes.max_tokens["arith"]))
            used["engine serving"] = _device_used_bytes(check.cuda)
        except Exception as e:  # the engine's log says why
            raise BenchError(f"the engine beside the offloaded trainer: {type(e).__name__}: {e}\nits log ends:\n{engine.tail()}") from e
        finally:
            engine.stop()
        used["engine stopped"] = _device_used_bytes(check.cuda)
        reloaded = trainer.update(**_train_config(check, data, work / "3", iteration=3, init=work / "2", init_iteration=2,
                                                  strategy="ddp"))
        used["reloaded and trained"] = _device_used_bytes(check.cuda)
    finally:
        trainer.close()
    if reloaded["stats"]["policy_from"] != "memory":
        raise BenchError(f"the third update loaded its policy from {reloaded['stats']['policy_from']}, not from memory: no reload measured")

    def gpu(done: dict, key: str) -> int | None:
        return (done["cuda"] or {}).get(key)

    out = {
        "offload_s": offloaded["timing"].get("offload"),
        "reload_s": reloaded["timing"]["load"],
        "moved": check.cuda,
        "trainer_allocated_bytes": {"trained": gpu(trained, "allocated_bytes"), "offloaded": gpu(offloaded, "allocated_bytes"),
                                    "reloaded": gpu(reloaded, "allocated_bytes")},
        "trainer_reserved_bytes": {"trained": gpu(trained, "reserved_bytes"), "offloaded": gpu(offloaded, "reserved_bytes"),
                                   "reloaded": gpu(reloaded, "reserved_bytes")},
        "device_used_bytes": used,
        "engine_beside_trainer": {"device": check.device, **served},
        "timing": {"trained": trained["timing"], "offloaded": offloaded["timing"], "reloaded": reloaded["timing"]},
    }
    if out["offload_s"] is None:
        raise BenchError("the offload update's timing has no 'offload' part: the trainer did not offload")
    table(f"kept-alive trainer (ddp, bf16): offload and reload around an engine on {check.device}",
          ["point", "trainer allocated MiB", "trainer reserved MiB", "device used MiB", "seconds"],
          [["trained (before offload)", _mib(out["trainer_allocated_bytes"]["trained"]), _mib(out["trainer_reserved_bytes"]["trained"]),
            _mib(used["trained"]), None],
           ["after offload", _mib(out["trainer_allocated_bytes"]["offloaded"]), _mib(out["trainer_reserved_bytes"]["offloaded"]),
            _mib(used["offloaded"]), out["offload_s"]],
           [f"engine serving ({served['tokens_per_s']} tok/s)", None, None, _mib(used["engine serving"]), served["seconds"]],
           ["after reload (and an update)", _mib(out["trainer_allocated_bytes"]["reloaded"]),
            _mib(out["trainer_reserved_bytes"]["reloaded"]), _mib(used["reloaded and trained"]), out["reload_s"]]],
          right_from=1)
    if not check.cuda:
        console.print("on the CPU the offload and the reload move nothing: the trainer moves its state off a GPU only", markup=False)
    return out


# -- publish -------------------------------------------------------------------------------------

def part_publish(check: Check) -> dict:
    """bench/publish.py's comparison at 1B (--quick: the demo's model), in a process of its own."""
    out = check.work / "publish.json"
    quick = check.sizes is QUICK
    argv = [sys.executable, str(Path(__file__).resolve().parent / "publish.py"), "--lrs=1e-6", f"--out={out}", f"--seed={check.seed}",
            f"--dir={check.work}", *(["--model=demo", f"--data-path={check.demo('arith')}", "--iterations=2", "--records=4", "--samples=2",
                                      "--completion-tokens=4"] if quick else ["--model=qwen1b", "--iterations=3"])]
    done = subprocess.run(argv, env=python_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise BenchError(f"bench/publish.py exited {done.returncode}:\n{(done.stderr or done.stdout)[-2000:]}")
    console.print(done.stdout.rstrip(), markup=False)
    result = json.loads(out.read_text())
    summary = result["summary"]["1e-06"]
    replay = result["runs"]["new"]["1e-06"].get("replay") or {}
    if replay and not replay.get("exact"):
        raise BenchError(f"the replay did not reach the same weights and state: {replay}")
    return {"model": result["model"], "device": check.device, "summary": summary, "replay": replay,
            "means": {name: result["runs"][name]["1e-06"]["mean"] for name in result["runs"]}}


# -- the check -----------------------------------------------------------------------------------

PARTS: dict[str, tuple[Callable[[Check], dict], str]] = {
    "machine": (part_machine, "torch, CUDA, the GPUs, nvidia-smi"),
    "demo": (part_demo, "demo data and chat demo data"),
    "engine": (part_engine, "the embedded engine on the GPU (--allow-cpu: the CPU), one request against many"),
    "engine-cpu": (part_engine_cpu, "the embedded engine on the CPU, for comparison"),
    "train": (part_train, "one bf16 step with DDP (packed, then padded), FSDP and LoRA"),
    "offload": (part_offload, "the trainer's offload and reload around an engine"),
    "publish": (part_publish, "a 1B model's weights published as bf16 deltas against today's fp32 checkpoint"),
}
NEEDS_DEMO = frozenset({"engine", "engine-cpu", "train", "offload", "publish"})


@dataclass(slots=True)
class Outcome:
    part: str
    ok: bool
    seconds: float
    error: str | None = None
    result: dict | None = None


def run_part(name: str, check: Check) -> Outcome:
    """One part, its failure caught and printed: the next part runs whatever this one did."""
    console.rule(f"{name}: {PARTS[name][1]}", style="dim")
    began = time.monotonic()
    try:
        result = PARTS[name][0](check)
    except Exception as e:  # every failure of a part is reported, never raised: the others still run
        message = f"{type(e).__name__}: {e}"
        if not isinstance(e, (BenchError, subprocess.SubprocessError)):
            message += "\n" + "".join(traceback.format_exception(e))[-3000:]
        err_console.print(f"gpu-check: part {name} FAILED: {message}", markup=False)
        return Outcome(name, False, round(time.monotonic() - began, 1), error=message)
    check.results[name] = result
    return Outcome(name, True, round(time.monotonic() - began, 1), result=result)


def _parts(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PARTS)}")
    if NEEDS_DEMO & set(names):
        names.append("demo")
    return [p for p in PARTS if p in names]  # in the table's order: demo before what needs it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu-check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    parser.add_argument("--parts", type=_parts, default=list(PARTS), help="comma-separated (default: all; demo comes with any that needs it)")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run every part on the CPU instead of exiting 2")
    parser.add_argument("--quick", action="store_true", help="small sizes: a few prompts, few tokens, one round")
    parser.add_argument("--engine-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the engine's --dtype (default: %(default)s, the checkpoint's: float32 for the demo)")
    parser.add_argument("--seed", type=int, default=0, help="of the demo data, the prompts chosen and the request plan")
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        err_console.print(f"gpu-check: no CUDA GPU here (torch {torch.__version__}, CUDA {torch.version.cuda or 'none: a CPU-only build'}, "
                          f"torch.cuda.is_available() is false); run it on a GPU machine, or pass --allow-cpu to run every part "
                          f"on the CPU", markup=False, soft_wrap=True)
        return EXIT_NO_CUDA
    sizes = QUICK if args.quick else FULL
    if not cuda:
        console.print("no CUDA: every part runs on the CPU (--allow-cpu)", markup=False)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        check = Check(sizes=sizes, work=Path(tmp), cuda=cuda, engine_dtype=args.engine_dtype, seed=args.seed)
        for name in args.parts:
            outcomes.append(run_part(name, check))

    passed = all(o.ok for o in outcomes)
    table(f"gpu-check on {'cuda' if cuda else 'cpu'}{' (quick)' if args.quick else ''}", ["part", "result", "seconds", "error"],
          [[o.part, "passed" if o.ok else "FAILED", o.seconds, None if o.ok else o.error.splitlines()[0][:120]] for o in outcomes],
          right_from=2)
    failed = [o.part for o in outcomes if not o.ok]
    console.print(f"gpu-check: {len(failed)} of {len(outcomes)} parts FAILED: {', '.join(failed)}" if failed
                  else f"gpu-check: every part passed ({len(outcomes)})", markup=False)
    write_json(args.out, {"bench": "gpu_check", "machine": machine(), "device": "cuda" if cuda else "cpu", "quick": args.quick,
                          "sizes": asdict(sizes), "engine_dtype": args.engine_dtype, "seed": args.seed, "passed": passed,
                          "parts": {o.part: asdict(o) for o in outcomes}})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
