"""Inference engines compared on this machine: the embedded engine, and vLLM when installed.

    python bench/engine_throughput.py --model /tmp/orch-data/model      # the demo's trained model
    python bench/engine_throughput.py                                   # a fresh (untrained) demo model
    python bench/engine_throughput.py --engines embedded --batches 10 --out /tmp/engine.json

For each engine, as a rank runs it:

    startup     process start -> /health answers 200 (embedded: ``python -m
                orchestrator.engine.server --port 0 --port-file F``; vLLM: the argv of
                ``orchestrator.engine.vllm.serve_command`` with ``--vllm-extra-args``)
    throughput  completion tokens / s over --batches requests like the rollout's: --prompts
                prompts x n=--n samples, --max-tokens, --temperature, logprobs=0, one
                request at a time, after one unmeasured warm-up request
    restart     stop (SIGTERM to the process group, until it has exited) + start on another
                checkpoint until healthy: what phase 7 + phase 12 cost today
vLLM only:
    reload      ``orchestrator.engine.vllm.reload_weights`` to the other checkpoint and back
                (mean of the two), checking that the served logprobs changed and came back
    sleep/wake  ``sleep`` + ``wake_up`` at levels 1 and 2 (on CPU, vLLM frees nothing)

The other checkpoint is --other, or else a copy of --model with every matrix perturbed
(same architecture). Prompts are "a+b=" with a, b drawn from a seeded generator, like the
demo tasks. Completion tokens are counted from the logprobs (EOS included), as the engines
generate them: a trained model stops after about 3 tokens, an untrained one runs to
--max-tokens, so compare engines on the same model only.

Prints a table and writes JSON to --out (default bench/results/engine.json in the checkout).
Exit status 1 when an engine fails to start or to serve.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/engine_throughput.py` from a checkout that is not installed
    sys.path.insert(0, str(REPO))

from orchestrator.engine import vllm as vllm_engine  # noqa: E402
from orchestrator.engine.client import EngineClient  # noqa: E402
from orchestrator.node.ports import free_port  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "engine.json"
NAME = "bench-policy"
PROBE = "17+25="


class BenchError(Exception):
    pass


class Engine:
    """One engine process in its own process group; ``start`` returns seconds to healthy."""

    def __init__(self, kind: str, args: argparse.Namespace, work: Path):
        self.kind, self.args, self.work = kind, args, work
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, model: Path) -> float:
        log = open(self.work / f"{self.kind}.log", "ab")
        began = time.monotonic()
        if self.kind == "embedded":
            port_file = self.work / "embedded.port"
            port_file.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "orchestrator.engine.server", "--model", str(model), "--port", "0",
                    "--port-file", str(port_file), "--served-model-name", NAME]
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
            while not port_file.exists():
                self._check_alive(began)
                time.sleep(0.02)
            self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        else:
            port = free_port(18300)
            argv = vllm_engine.serve_command(
                model=str(model), served_model_name=NAME, port=port, host="127.0.0.1", dtype=self.args.dtype,
                gpu_memory_utilization=self.args.gpu_memory_utilization, extra_args=self.args.vllm_extra_args,
            )
            env = vllm_engine.serve_env(gpus=(), base=os.environ)
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.url = f"http://127.0.0.1:{port}"
        log.close()
        EngineClient(self.url, timeout_s=10).wait_healthy(
            self.args.startup_timeout_s - (time.monotonic() - began), should_stop=lambda: self.proc.poll() is not None
        )
        self._check_alive(began)
        return time.monotonic() - began

    def _check_alive(self, began: float) -> None:
        if self.proc.poll() is not None or time.monotonic() - began > self.args.startup_timeout_s:
            tail = (self.work / f"{self.kind}.log").read_text(errors="replace")[-3000:]
            raise BenchError(f"{self.kind} did not start (exit code {self.proc.poll()}):\n{tail}")

    def stop(self) -> float:
        """Seconds from SIGTERM to the group's leader having exited (SIGKILL after 30 s)."""
        if self.proc is None:
            return 0.0
        began = time.monotonic()
        for sig, grace_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        seconds = time.monotonic() - began
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever the leader left behind
        except ProcessLookupError:
            pass
        self.proc = None
        return seconds

    def client(self) -> EngineClient:
        return EngineClient(self.url, timeout_s=600, model=NAME)


def _prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(count)]


def _throughput(client: EngineClient, args: argparse.Namespace) -> dict:
    prompts = _prompts(args.prompts, args.seed)

    def batch(seed: int) -> tuple[float, int]:
        began = time.monotonic()
        groups = client.complete(prompts, n=args.n, temperature=args.temperature, top_p=1.0,
                                 max_tokens=args.max_tokens, seed=seed, logprobs=0)
        seconds = time.monotonic() - began
        return seconds, sum(len(c.tokens) for g in groups for c in g)

    batch(10_000)  # warm-up
    runs = [batch(args.seed + i) for i in range(args.batches)]
    seconds = sum(s for s, _ in runs)
    tokens = sum(t for _, t in runs)
    return {
        "batches": args.batches,
        "completion_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "batch_s_median": round(statistics.median(s for s, _ in runs), 4),
        "tokens_per_batch": round(tokens / args.batches, 1),
    }


def _probe(client: EngineClient) -> list[float]:
    [[c]] = client.complete([PROBE], n=1, temperature=0, max_tokens=8, logprobs=0)
    return c.token_logprobs


def _timed(fn, *a, **kw) -> tuple[float, object]:
    began = time.monotonic()
    result = fn(*a, **kw)
    return time.monotonic() - began, result


def bench_engine(kind: str, model: Path, other: Path, args: argparse.Namespace, work: Path) -> dict:
    engine = Engine(kind, args, work)
    out: dict = {}
    try:
        out["startup_s"] = round(engine.start(model), 2)
        client = engine.client()
        out.update(_throughput(client, args))
        if kind == "vllm":
            base_lp = _probe(client)
            t_there, ok_there = _timed(vllm_engine.reload_weights, engine.url, str(other), 300)
            other_lp = _probe(client)
            t_back, ok_back = _timed(vllm_engine.reload_weights, engine.url, str(model), 300)
            if not (ok_there and ok_back):
                raise BenchError("vLLM answered that it cannot reload weights in place (no VLLM_SERVER_DEV_MODE?)")
            out["reload_s"] = round((t_there + t_back) / 2, 4)
            out["reload_changed_logprobs"] = other_lp != base_lp
            out["reload_restored_logprobs"] = _probe(client) == base_lp
            for level in (1, 2):
                t_sleep, _ = _timed(vllm_engine.sleep, engine.url, level, 60)
                t_wake, _ = _timed(vllm_engine.wake_up, engine.url, 60)
                out[f"sleep{level}_s"] = round(t_sleep, 4)
                out[f"wake{level}_s"] = round(t_wake, 4)
            vllm_engine.reload_weights(engine.url, str(model), 300)  # level 2 may have discarded the weights
        stop_s = engine.stop()
        start_s = engine.start(other)
        _probe(engine.client())
        out["restart_stop_s"] = round(stop_s, 2)
        out["restart_start_s"] = round(start_s, 2)
        out["restart_s"] = round(stop_s + start_s, 2)
    finally:
        engine.stop()
    return out


def _perturbed_copy(model: Path, dest: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    for f in dest.glob("*.safetensors"):
        weights = load_file(f)
        g = torch.Generator().manual_seed(0)
        weights = {k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.ndim == 2 else v).contiguous()
                   for k, v in weights.items()}
        tmp = f.with_suffix(".tmp")
        save_file(weights, tmp, metadata={"format": "pt"})
        os.replace(tmp, f)  # not over the file while its tensors may still be mapped
    return dest


def _table(results: dict) -> str:
    rows = [
        ("startup (start -> healthy)", "startup_s", "s"),
        ("throughput", "tokens_per_s", "completion tokens/s"),
        ("batch (median)", "batch_s_median", "s"),
        ("completion tokens per batch", "tokens_per_batch", ""),
        ("restart on a new checkpoint", "restart_s", "s"),
        ("  of which stop", "restart_stop_s", "s"),
        ("in-place reload", "reload_s", "s"),
        ("sleep / wake, level 1", ("sleep1_s", "wake1_s"), "s"),
        ("sleep / wake, level 2", ("sleep2_s", "wake2_s"), "s"),
    ]
    engines = list(results)
    lines = [f"{'':32}" + "".join(f"{e:>18}" for e in engines)]
    for label, key, unit in rows:
        cells = []
        for e in engines:
            r = results[e]
            if isinstance(key, tuple):
                cells.append(" / ".join(str(r[k]) for k in key) if all(k in r for k in key) else "-")
            else:
                cells.append(str(r.get(key, "-")))
        lines.append(f"{label:32}" + "".join(f"{c:>18}" for c in cells) + f"  {unit}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="Hugging Face checkpoint directory (default: a fresh demo model)")
    parser.add_argument("--other", type=Path, help="a second checkpoint, same architecture (default: --model perturbed)")
    parser.add_argument("--engines", default="embedded,vllm", help="comma-separated; vllm is skipped when not installed")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="vLLM --dtype (default: %(default)s)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.1, help="vLLM (default: %(default)s)")
    parser.add_argument("--vllm-extra-args", default="--enforce-eager", help="appended to vLLM's argv (default: %(default)s)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = parser.parse_args(argv)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "vllm" in engines and importlib.util.find_spec("vllm") is None:
        print("vllm is not installed (scripts/setup-vllm.sh): benchmarking the embedded engine only", file=sys.stderr)
        engines.remove("vllm")
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from orchestrator.demo import model as demo_model

            model = work / "model"
            demo_model.save(demo_model.create(args.seed), model)
        model = model.resolve()
        other = (args.other or _perturbed_copy(model, work / "other")).resolve()
        results = {}
        try:
            for kind in engines:
                print(f"benchmarking {kind} ...", file=sys.stderr, flush=True)
                results[kind] = bench_engine(kind, model, other, args, work)
        except BenchError as e:
            print(f"engine bench failed: {e}", file=sys.stderr)
            return 1

    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "vllm"):
        if importlib.util.find_spec(package) is not None:
            versions[package] = __import__(package).__version__
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "versions": versions,
        "settings": {"model": str(args.model or "fresh demo model"), "other": str(args.other or "--model perturbed"),
                     "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "batches": args.batches, "seed": args.seed,
                     "vllm_argv_extra": f"--dtype {args.dtype} --gpu-memory-utilization {args.gpu_memory_utilization} "
                                        f"{args.vllm_extra_args}"},
        "results": results,
    }
    print(_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
