"""The embedded engine's continuous batching: many small requests against one request that
carries every prompt, on the same engine process and the same prompts.

    python bench/engine_batching.py                                    # both settings, demo data made here; ~6 min on 2 cores
    python bench/engine_batching.py --settings arith --data-path /tmp/orch-data
    python bench/engine_batching.py --settings chat --chat-data-path /tmp/chat-data --prompts 128

Settings (each on its own demo data, ``orchestrator demo-data --warm-steps`` 5 by default):

arith   the default demo (Llama architecture): ``--prompts`` (384) task prompts x n=``--n`` (8)
        samples, max_tokens 8
chat    the chat demo (``demo-data --chat``, Qwen2 architecture, prompts through its chat
        template): the same counts, max_tokens 64

For each setting one engine (``python -m orchestrator.engine.server``) serves both modes over
HTTP, ``--rounds`` times each, alternating, after one unmeasured warm-up request:

one     one request carrying every prompt (seed fixed)
many    requests of ``--request-prompts`` (1-4) prompts each (sizes and seeds drawn from
        ``--seed``), sent from one asyncio loop over an httpx.AsyncClient with up to M
        sequences (prompts x n) outstanding, as the rollout keeps them
        (``workloads/rl/engine_requests.py``); a request larger than that goes alone. One mode per
        M of ``--max-inflight``: 0 is every sequence at once (the same work in flight as
        one), 256 the rollout's default for this engine

With ``--in-process``, the same modes run again on the engine's scheduler in this process
(``orchestrator.engine.scheduler``, the same request plan, no HTTP and no client): the gap
between the two paths is what HTTP and the client cost per request.

Throughput is completion tokens (the server's ``usage``, EOS included) per wall second, from
the first request sent to the last answer; the figure per mode is the best round (the
others are in the JSON, with the CPU seconds the engine process and this client spent on
each, and the engine scheduler's busy seconds). The ratio is many's over one's. ``--threads`` sets the engine's
OMP_NUM_THREADS: on a machine whose cores are busy with other work, torch's default of a
thread per core makes every step wait for the slowest thread, and the figures mean little. The engine's ``GET /stats`` before
and after each many round gives how many requests joined a running batch and the most
requests decoded in one step. Prints a table; writes JSON (default
bench/results/engine_batching.json). Exit status 1 when the engine fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, console, err_console, kill_tree, machine, python_env, table, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "engine_batching.json"
NAME = "bench-policy"
STARTUP_S = 120.0
REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class Setting:
    demo_args: tuple[str, ...]
    max_tokens: int
    data_option: str
    """The CLI option that names existing demo data for this setting."""


SETTINGS = {
    "arith": Setting(demo_args=(), max_tokens=8, data_option="data_path"),
    "chat": Setting(demo_args=("--chat",), max_tokens=64, data_option="chat_data_path"),
}


def make_demo(setting: Setting, path: Path, warm_steps: int) -> Path:
    console.print(f"making demo data in {path} ...", markup=False)
    subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}", f"--warm-steps={warm_steps}",
                    *setting.demo_args], check=True, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def prompts(data: Path, count: int, seed: int) -> list[str]:
    """``count`` training prompts as the rollout sends them (chat ones through the template)."""
    from transformers import AutoTokenizer

    from orchestrator.data import tasks as data_tasks
    from orchestrator.demo import tasks as demo_tasks

    tokenizer = AutoTokenizer.from_pretrained(data / "model")
    rows = demo_tasks.read_tasks(data / "tasks" / "train.jsonl")
    chosen = random.Random(seed).sample(rows, min(count, len(rows)))
    return [data_tasks.render(t["prompt"], tokenizer) for t in chosen]


class Engine:
    """The server process on a port it picked (``--port-file``), its log in ``work``."""

    def __init__(self, model: Path, work: Path, max_num_seqs: int | None, threads: int | None):
        self.log_path = work / "engine.log"
        port_file = work / "engine.port"
        argv = [sys.executable, "-m", "orchestrator.engine.server", "--model", str(model), "--port", "0",
                "--port-file", str(port_file), "--served-model-name", NAME]
        if max_num_seqs is not None:
            argv += ["--max-num-seqs", str(max_num_seqs)]
        env = python_env()
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_S
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"the engine did not start (exit code {self.proc.poll()}):\n{self.tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def cpu_s(self) -> float:
        """User + system CPU seconds of the engine process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        kill_tree(self.proc)


async def _post(http, url: str, body: dict) -> int:
    """Completion tokens of one request."""
    response = await http.post(url + "/v1/completions", json=body)
    if response.status_code != 200:
        raise BenchError(f"the engine answered {response.status_code}: {response.text[:500]}")
    return response.json()["usage"]["completion_tokens"]


def _body(prompts: list[str], args: argparse.Namespace, max_tokens: int, seed: int) -> dict:
    return {"model": NAME, "prompt": prompts, "n": args.n, "temperature": args.temperature, "max_tokens": max_tokens,
            "seed": seed, "logprobs": 0}


def split(count: int, sizes: tuple[int, int], seed: int) -> list[int]:
    """Request sizes (prompts each) drawn from ``sizes`` (inclusive) that add up to ``count``."""
    rng = random.Random(seed)
    out: list[int] = []
    while sum(out) < count:
        out.append(min(rng.randint(*sizes), count - sum(out)))
    return out


async def run_one(url: str, ps: list[str], args: argparse.Namespace, max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
        began = time.monotonic()
        tokens = await _post(http, url, _body(ps, args, max_tokens, args.seed))
        seconds = time.monotonic() - began
    return _rate(1, tokens, seconds)


async def run_many(url: str, ps: list[str], args: argparse.Namespace, max_tokens: int, max_inflight: int, round_: int) -> dict:
    """Requests of 1-4 prompts with up to ``max_inflight`` sequences outstanding."""
    import httpx

    plan = _request_plan(ps, args, round_)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    inflight = 0
    room = asyncio.Condition()
    tokens = 0

    async def one(http, chunk: list[str], seed: int) -> None:
        nonlocal inflight, tokens
        sequences = len(chunk) * args.n
        async with room:
            await room.wait_for(lambda: inflight == 0 or inflight + sequences <= max_inflight)
            inflight += sequences
        try:
            got = await _post(http, url, _body(chunk, args, max_tokens, seed))
            tokens += got
        finally:
            async with room:
                inflight -= sequences
                room.notify_all()

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        began = time.monotonic()
        await asyncio.gather(*(one(http, chunk, seed) for chunk, seed in plan))
        seconds = time.monotonic() - began
    return _rate(len(plan), tokens, seconds)


def _stats(url: str) -> dict:
    import httpx

    return httpx.get(url + "/stats", timeout=30).json()


def _request_plan(ps: list[str], args: argparse.Namespace, round_: int) -> list[tuple[list[str], int]]:
    """many's requests: (prompts, seed) in sending order."""
    plan, at = [], 0
    for i, size in enumerate(split(len(ps), args.request_prompts, args.seed + round_)):
        plan.append((ps[at : at + size], args.seed * 100_003 + i))
        at += size
    return plan


def http_rounds(engine: Engine, ps: list[str], args: argparse.Namespace, max_tokens: int, inflight: list[int]) -> dict:
    from orchestrator.engine.client import EngineClient

    EngineClient(engine.url, timeout_s=30).wait_healthy(deadline_s=STARTUP_S, should_stop=lambda: engine.proc.poll() is not None)
    asyncio.run(run_one(engine.url, ps[:4], args, max_tokens))  # warm-up
    rounds: dict[str, list[dict]] = {"one": [], **{f"many@{m}": [] for m in inflight}}

    def measured(mode: str, run) -> None:
        before, engine_cpu, client_cpu = _stats(engine.url), engine.cpu_s(), time.process_time()
        result = asyncio.run(run)
        result["client_cpu_s"] = round(time.process_time() - client_cpu, 3)
        result["engine_cpu_s"] = round(engine.cpu_s() - engine_cpu, 3)
        after = _stats(engine.url)
        for key in ("steps", "joined_running", "busy_s"):
            result[key] = round(after[key] - before[key], 3)
        rounds[mode].append(result)

    for r in range(args.rounds):
        console.print(f"http: round {r + 1}/{args.rounds} ...", markup=False, style="dim")
        measured("one", run_one(engine.url, ps, args, max_tokens))
        for m in inflight:
            measured(f"many@{m}", run_many(engine.url, ps, args, max_tokens, m, r))
    return rounds


def in_process_rounds(data: Path, ps: list[str], args: argparse.Namespace, max_tokens: int, inflight: list[int]) -> dict:
    """The same modes on the engine's Scheduler in this process: no HTTP, no client, so what
    is left is how well the engine batches across requests."""
    import gc
    import threading

    import torch

    from orchestrator.demo.model import load
    from orchestrator.engine.sampling import Sampler, SamplingParams
    from orchestrator.engine.scheduler import GenerationJob, Scheduler
    from orchestrator.engine.server import DEFAULT_MAX_NUM_SEQS

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(data / "model")
    scheduler = Scheduler(Sampler(model, tokenizer), max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
    gc.collect()
    gc.freeze()  # as the server does
    scheduler.start()

    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=args.n, temperature=args.temperature, max_tokens=max_tokens, seed=seed, logprobs=0)

    def tokens(generation) -> int:
        return sum(len(s.token_ids) for group in generation.samples for s in group)

    def one() -> dict:
        began = time.monotonic()
        count = tokens(scheduler.submit(GenerationJob(ps, params(args.seed))).result())
        return _rate(1, count, time.monotonic() - began)

    def many(max_inflight: int, round_: int) -> dict:
        plan = _request_plan(ps, args, round_)
        room = threading.Condition()
        outstanding = 0
        began = time.monotonic()
        futures = []
        for chunk, seed in plan:
            sequences = len(chunk) * args.n
            with room:
                room.wait_for(lambda: outstanding == 0 or outstanding + sequences <= max_inflight)
                outstanding += sequences
            future = scheduler.submit(GenerationJob(chunk, params(seed)))

            def done(_, sequences=sequences) -> None:
                nonlocal outstanding
                with room:
                    outstanding -= sequences
                    room.notify()

            future.add_done_callback(done)
            futures.append(future)
        count = sum(tokens(f.result()) for f in futures)
        return _rate(len(plan), count, time.monotonic() - began)

    try:
        one_prompt = SamplingParams(max_tokens=max_tokens)
        scheduler.submit(GenerationJob(ps[:4], one_prompt)).result()  # warm-up
        rounds: dict[str, list[dict]] = {"one": [], **{f"many@{m}": [] for m in inflight}}
        for r in range(args.rounds):
            console.print(f"in-process: round {r + 1}/{args.rounds} ...", markup=False, style="dim")
            rounds["one"].append(one())
            for m in inflight:
                rounds[f"many@{m}"].append(many(m, r))
    finally:
        scheduler.stop(10)
    return rounds


def _rate(requests: int, tokens: int, seconds: float) -> dict:
    return {"requests": requests, "completion_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def summary(rounds: dict, inflight: list[int]) -> dict:
    """The best round of each mode, and many's ratios to one."""
    best = {mode: max(runs, key=lambda x: x["tokens_per_s"]) for mode, runs in rounds.items()}
    one = best["one"]["tokens_per_s"]
    return {
        "one_tokens_per_s": one,
        "many": {m: {"max_inflight": m, "tokens_per_s": best[f"many@{m}"]["tokens_per_s"], "requests": best[f"many@{m}"]["requests"],
                     "ratio": round(best[f"many@{m}"]["tokens_per_s"] / one, 3)} for m in inflight},
        "rounds": rounds,
    }


def bench_setting(name: str, data: Path, args: argparse.Namespace, work: Path) -> dict:
    setting = SETTINGS[name]
    max_tokens = args.max_tokens or setting.max_tokens
    ps = prompts(data, args.prompts, args.seed)
    inflight = [m or len(ps) * args.n for m in args.max_inflight]
    out = {"data": str(data), "prompts": len(ps), "n": args.n, "max_tokens": max_tokens}
    console.print(f"{name}: {len(ps)} prompts x {args.n}, max_tokens {max_tokens}", markup=False)
    engine = Engine(data / "model", work, args.max_num_seqs, args.threads)
    try:
        out["http"] = summary(http_rounds(engine, ps, args, max_tokens, inflight), inflight)
    except BenchError as e:
        raise BenchError(f"{name}: {e}\n{engine.tail()}") from e
    finally:
        engine.stop()
    if args.in_process:
        out["in_process"] = summary(in_process_rounds(data, ps, args, max_tokens, inflight), inflight)
    return out


def _sizes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    sizes = (int(lo), int(hi or lo))
    if not 1 <= sizes[0] <= sizes[1]:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 1 <= LO <= HI, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="arith,chat", help=f"comma-separated, of {', '.join(SETTINGS)} (default: %(default)s)")
    parser.add_argument("--data-path", type=Path, help="demo data for arith (default: made here)")
    parser.add_argument("--chat-data-path", type=Path, help="chat demo data for chat (default: made here)")
    parser.add_argument("--warm-steps", type=int, default=5, help="demo-data --warm-steps when made here (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=384, help="prompts per mode and round (default: %(default)s)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, help="override the setting's max_tokens (arith 8, chat 64)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--request-prompts", type=_sizes, default=(1, 4), help="prompts per request in many, LO-HI (default: 1-4)")
    parser.add_argument("--max-inflight", type=lambda t: [int(m) for m in t.split(",")], default=[0, 256],
                        help="sequences outstanding in many, one mode per comma-separated value; 0: every sequence "
                             "(default: 0,256; 256 is the rollout's default for the embedded engine)")
    parser.add_argument("--threads", type=int, help="the engine's OMP_NUM_THREADS (default: torch's own)")
    parser.add_argument("--max-num-seqs", type=int, help="the engine's --max-num-seqs (default: the engine's)")
    parser.add_argument("--in-process", action="store_true",
                        help="also run the modes on the engine's scheduler in this process, without HTTP")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (one, many) per setting (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")

    results = {}
    with tempfile.TemporaryDirectory(prefix="engine-batching-") as tmp:
        work = Path(tmp)
        try:
            for name in names:
                setting = SETTINGS[name]
                data = getattr(args, setting.data_option) or make_demo(setting, work / f"{name}-data", args.warm_steps)
                run_dir = work / name
                run_dir.mkdir()
                results[name] = bench_setting(name, data.resolve(), args, run_dir)
        except (BenchError, subprocess.CalledProcessError) as e:
            err_console.print(f"engine batching bench failed: {e}", markup=False)
            return 1

    table(
        f"embedded engine: one request vs many of {args.request_prompts[0]}-{args.request_prompts[1]} prompts "
        f"with up to M sequences in flight, completion tokens/s",
        ["setting", "path", "prompts x n", "max_tokens", "one request", "M", "many requests", "requests", "ratio"],
        [[name, path, f"{r['prompts']} x {r['n']}", r["max_tokens"], r[key]["one_tokens_per_s"], m["max_inflight"],
          m["tokens_per_s"], m["requests"], m["ratio"]]
         for name, r in results.items() for path, key in (("http", "http"), ("in-process", "in_process")) if key in r
         for m in r[key]["many"].values()],
        right_from=2,
    )
    write_json(args.out, {
        "machine": machine(),
        "settings": {"settings": names, "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
                     "temperature": args.temperature, "request_prompts": list(args.request_prompts),
                     "max_inflight": args.max_inflight, "max_num_seqs": args.max_num_seqs, "threads": args.threads,
                     "rounds": args.rounds, "in_process": args.in_process,
                     "seed": args.seed, "warm_steps": args.warm_steps},
        "results": results,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
