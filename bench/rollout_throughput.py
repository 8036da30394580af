"""A rank's rollout against its engine's saturated throughput: how much of what the engine
can do the rollout gets, with many requests in flight, and what it got the way it was before.

    python bench/rollout_throughput.py --max-load 1.5          # demo data made here; embedded, and vLLM if this python has it
    python bench/rollout_throughput.py --data-path /tmp/orch-data --chat-data-path /tmp/orch-chat --engines embedded
    python bench/rollout_throughput.py --python /tmp/vllm-venv/bin/python --rounds 3 --max-load 1.5

Settings (each on its own demo data, made here unless given):

arith   the default demo (``orchestrator demo-data --warm-steps 100``): ``--tasks`` (384)
        train tasks x ``--n`` (8) samples, ``rl.max_tokens=8``; completions of 2 to 4 tokens
chat    the chat demo (``demo-data --chat --warm-steps 10``, prompts through its chat
        template, graded by ``rl.reward=orchestrator.rewards:math``): the same counts,
        ``rl.max_tokens=64``. Ten warm-start steps leave a model whose completions run from a
        few tokens to 64 (median about 30, a fifth cut at 64); at 100 steps it answers in 6

For each setting and engine, one engine process serves every mode (embedded: ``python -m
orchestrator.engine.server``; vLLM: ``orchestrator.engine.vllm.serve_command`` run by
``--python``, float32, ``--vllm-args``: see ``VLLM_SERVER_ARGS``). One unmeasured rollout
first warms it and gives the prompts (its shard: the tasks a rank samples in iteration 1,
rendered). Then ``--rounds`` times, after the load average is below ``--max-load``:

rollout    a real rank: ``python -m orchestrator run --rl-phase rollout --rollout-split
           train-only --max-iterations 1 --debug-mode rollout.engine_url=URL`` on a fresh log
           path, its requests as the run makes them (``prompts_per_request`` prompts each, up
           to ``DEFAULT_MAX_INFLIGHT`` sequences in flight). Seconds: the run's own phase 1
           (``status --json``: from the rank entering the rollout to entering phase 2, the
           engine already up); tokens: every sample's ``token_ids`` in its shard. The JSON
           also splits the phase: before the first request left, the requests' span (first
           sent to last answered, from the records), and after the last answer (the scoring
           and writing still to do)
saturated  the engine's own best on the same prompts and sampling. Embedded: one request
           carrying every prompt. vLLM: ``vllm.LLM(...).generate(every prompt)`` offline in a
           process of its own (run before the server starts, all rounds in one process, its
           start not counted), a seed per prompt, with ``--vllm-offline-args``
one        vLLM only: one HTTP request carrying every prompt to the server (saturated as the
           server is configured; for the embedded engine this is saturated)
requests   the rollout's request path alone: ``workloads/rl/engine_requests.py``'s ``Inflight`` with
           the rollout's request size and in-flight budget, without the phase around it (no
           claims, scoring, records or fsync): what is left between it and rollout is the
           phase's own cost
today      before requests in flight: ``Inflight`` with 16 prompts a request and one request
           in flight (``max_sequences`` = 16 x n), over the same prompts. Like requests, it
           leaves out the phase's own cost, so rollout / today understates the gain

Diagnostics, when asked for: ``--cheap-reward`` adds ``rollout_exact_match``, the rollout
again with ``rl.reward=orchestrator.rewards:exact_match`` where the setting grades with
another reward (chat): what grading costs the rollout on the engine's cores.
``--rollout-request-sizes K,...`` adds ``rollout@K``: the rollout again with
``rollout.prompts_per_request=K``. ``--request-sizes K,...`` adds ``requests@K``: the request
path with K prompts a request at the rollout's in-flight budget.

Sampling is the rollout's in every mode: temperature 1, top_p 1, ``logprobs=0``, token ids
returned, each request seeded. Throughput is completion tokens (EOS included) per second;
the figure per mode is the ``--pick`` (median, or best) of the rounds, all of which are in
the JSON with the load average each started under. A mode that fails in a round is recorded
(``failures``, with the end of the engine's log) and the round goes on. Prints a table;
writes JSON (default bench/results/rollout_throughput.json) after each engine. Exit status
1 when anything failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    REPO, RESULTS, BenchError, console, err_console, kill_tree, machine, python_env, run_iterations, table, wait_for_quiet,
    write_json,
)

DEFAULT_OUT = RESULTS / "rollout_throughput.json"
NAME = "bench-policy"
ENGINES = ("embedded", "vllm")
CHEAP_REWARD = "rl.reward=orchestrator.rewards:exact_match"
TODAY_PROMPTS_PER_REQUEST = 16
"""What one rollout request carried before requests in flight, one request at a time."""
TEMPERATURE = 1.0
VLLM_OFFLINE_ARGS = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}
VLLM_SERVER_ARGS = "--enforce-eager --max-num-seqs 256 --max-num-batched-tokens 16384"
"""The same limits on both sides, so that saturated is the server's engine at its best: 256
sequences is vLLM's offline default on CPU (its server's is 128), and a token budget that
fits every prefill keeps vLLM 0.32's CPU worker from dying on a seeded request whose prefill
is split over two steps (it rewinds the request's generator offset, which a CPU generator
does not have: "CPU Generator does not use offset")."""
STARTUP_S = 300.0
REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True, slots=True)
class Setting:
    demo_args: tuple[str, ...]
    warm_steps: int
    """``demo-data --warm-steps`` when the data is made here."""
    max_tokens: int
    overrides: tuple[str, ...]
    """``orchestrator run`` keys this setting needs beside the common ones."""
    data_option: str
    """The CLI option that names existing demo data for this setting."""


SETTINGS = {
    "arith": Setting(demo_args=(), warm_steps=100, max_tokens=8, overrides=(), data_option="data_path"),
    "chat": Setting(demo_args=("--chat",), warm_steps=10, max_tokens=64, overrides=("rl.reward=orchestrator.rewards:math",),
                    data_option="chat_data_path"),
}


def sampling(setting: Setting, n: int) -> dict:
    """The keyword arguments of ``EngineClient.complete`` that the rollout sends (``RLWorkload.rollout_pipe``)."""
    return {"n": n, "temperature": TEMPERATURE, "top_p": 1.0, "max_tokens": setting.max_tokens, "stop": [], "logprobs": 0,
            "return_token_ids": True}


def make_demo(setting: Setting, path: Path, warm_steps: int) -> Path:
    console.print(f"making demo data in {path} ...", markup=False)
    subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", f"--data-path={path}", f"--warm-steps={warm_steps}",
                    *setting.demo_args], check=True, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def has_vllm(python: str) -> bool:
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", code], env=python_env(), capture_output=True).returncode == 0


# -- engines -------------------------------------------------------------------------------------

class VllmServer:
    """vLLM's OpenAI server on CPU, as a rank would run it (``serve_command``, ``serve_env``)."""

    def __init__(self, model: Path, work: Path, python: str, extra_args: str):
        from orchestrator.engine import vllm as vllm_engine
        from orchestrator.engine.client import EngineClient
        from orchestrator.node.ports import free_port

        self.log_path = work / "vllm.log"
        port = free_port(18300)
        argv = vllm_engine.serve_command(model=str(model), served_model_name=NAME, port=port, host="127.0.0.1", dtype="float32",
                                         gpu_memory_utilization=0.1, extra_args=extra_args, python=python)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=vllm_engine.serve_env(gpus=(), base=python_env()))
        self.url = f"http://127.0.0.1:{port}"
        try:
            EngineClient(self.url, timeout_s=10).wait_healthy(STARTUP_S, should_stop=lambda: self.proc.poll() is not None)
        except Exception as e:
            self.stop()
            raise BenchError(f"vLLM did not start (exit code {self.proc.poll()}): {e}\n{self.tail()}") from e
        if self.proc.poll() is not None:
            raise BenchError(f"vLLM exited with {self.proc.poll()}:\n{self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        kill_tree(self.proc)


def start_engine(engine: str, model: Path, work: Path, args: argparse.Namespace):
    if engine == "vllm":
        return VllmServer(model, work, args.python, args.vllm_args)
    from bench.engine_batching import Engine

    embedded = Engine(model, work, max_num_seqs=None, threads=args.threads)
    from orchestrator.engine.client import EngineClient

    EngineClient(embedded.url, timeout_s=30).wait_healthy(STARTUP_S, should_stop=lambda: embedded.proc.poll() is not None)
    return embedded


# -- the modes -----------------------------------------------------------------------------------

def _rate(tokens: int, seconds: float, **more) -> dict:
    return {"completion_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), **more}


def _tokens(groups) -> int:
    return sum(len(c.token_ids) for group in groups for c in group)


def one_request(url: str, prompts: list[str], params: dict, seed: int) -> dict:
    """Every prompt in one request."""
    from orchestrator.engine.client import EngineClient

    client = EngineClient(url, timeout_s=REQUEST_TIMEOUT_S)
    client.model()
    began = time.monotonic()
    groups = client.complete(prompts, seed=seed, **params)
    return _rate(_tokens(groups), time.monotonic() - began, requests=1)


def plan_requests(task_ids: list[str], prompts: list[str], per_request: int, seed: int) -> list:
    """``inflight.Request``s of ``per_request`` prompts in order, each with its own seed."""
    from orchestrator.workloads.rl.engine_requests import Request

    rng = random.Random(seed)
    return [Request(task_ids[i : i + per_request], prompts[i : i + per_request], rng.randrange(2**31))
            for i in range(0, len(prompts), per_request)]


def through_inflight(url: str, task_ids: list[str], prompts: list[str], params: dict, *, per_request: int, max_sequences: int,
                     seed: int) -> dict:
    """The rollout's request path (``Inflight``) alone: every request submitted at once, the
    clock stopped at the last answer. Raises the engine's failure."""
    from orchestrator.engine.client import EngineClient
    from orchestrator.workloads.rl.engine_requests import Inflight

    client = EngineClient(url, timeout_s=REQUEST_TIMEOUT_S)
    client.model()
    requests = plan_requests(task_ids, prompts, per_request, seed)
    inflight = Inflight([client], max_sequences=max_sequences, sampling=params, timeout_s=REQUEST_TIMEOUT_S)
    answers = []
    try:
        began = time.monotonic()
        inflight.submit(requests)
        while len(answers) < len(requests):
            if time.monotonic() - began > REQUEST_TIMEOUT_S:
                raise BenchError(f"{len(requests) - len(answers)} of {len(requests)} requests unanswered after {REQUEST_TIMEOUT_S:g} s")
            answers += inflight.answers(timeout_s=1.0)
        seconds = time.monotonic() - began
    finally:
        inflight.close()
    return _rate(sum(_tokens(a.groups) for a in answers), seconds, requests=len(requests),
                 peak_sequences=inflight.stats.peak_sequences[0], prompts_per_request=per_request, max_sequences=max_sequences)


def read_rollout(log_path: Path) -> dict:
    """What a finished one-rank rollout of iteration 1 wrote: its train shard's records, and
    where its phase 1 (wall clock, from its event log) went beside the requests' span (from
    the first request sent to the last answered)."""
    from orchestrator.ops.event_fold import EventReader
    from orchestrator.phase_table import Phase
    from orchestrator.protocol.layout import RunLayout

    layout = RunLayout(log_path)
    shard = layout.iteration(1).shard("train", 0)
    lengths, prompts, sent, answered = [], {}, [], []
    with open(shard, "rb") as f:
        for line in f:
            record = json.loads(line)
            prompts[record["task_id"]] = record["prompt"]
            lengths += [len(s["token_ids"]) for s in record["samples"]]
            sent.append(record["sent_at"])
            answered.append(record["sent_at"] + record["seconds"])
    if not lengths:
        raise BenchError(f"{shard} holds no records")
    [phase] = [s for log in EventReader(layout, timeline=True).read() if log.rank == 0 for s in log.segments()
               if s["kind"] == "work" and (s["iteration"], s["phase"]) == (1, Phase.ROLLOUT)]
    return {"tasks": len(prompts), "samples": len(lengths), "completion_tokens": sum(lengths), "lengths": lengths,
            "prompts": prompts, "requests_span_s": round(max(answered) - min(sent), 3),
            "before_first_request_s": round(min(sent) - phase["t_start"], 3),
            "after_last_answer_s": round(phase["t_end"] - max(answered), 3)}


def rollout_run(python: str, engine: str, url: str, data: Path, log_path: Path, setting: Setting, args: argparse.Namespace,
                more: tuple[str, ...] = ()) -> dict:
    """One rank's rollout of ``--tasks`` tasks against the engine at ``url`` (``more``: keys
    after the setting's); its rollout phase's seconds from the run's own events (``status --json``)."""
    argv = [python, "-m", "orchestrator", "run", f"--data-path={data}", f"--log-path={log_path}", "--rl-phase=rollout",
            "--rollout-split=train-only", "--max-iterations=1", "--debug-mode", f"rollout.engine_url={url}",
            f"rollout.engine={engine}", f"rl.train_tasks={args.tasks}", f"rl.samples_per_prompt={args.n}",
            f"rl.max_tokens={setting.max_tokens}", f"rl.temperature={TEMPERATURE}", *setting.overrides, *more]
    try:
        wall, [iteration] = run_iterations(argv, log_path, iterations=1, env=python_env(), timeout_s=args.run_timeout_s,
                                           what=f"the {engine} rollout on {log_path}")
    except BenchError as e:
        out = log_path.with_name(log_path.name + ".out")
        raise BenchError(f"{e}; it ends:\n{out.read_text(errors='replace')[-3000:]}") from e
    seconds = iteration["timing"]["phases"].get("1:rollout")
    if seconds is None:
        raise BenchError(f"{log_path}: status has no time for phase 1:rollout")
    got = read_rollout(log_path)
    return {**got, **_rate(got["completion_tokens"], seconds), "run_wall_s": round(wall, 3)}


# -- vLLM offline ----------------------------------------------------------------------------------

def vllm_offline(spec_path: str) -> None:
    """Runs in ``--python``: ``vllm.LLM.generate`` over every prompt, ``rounds`` times after a
    warm-up; writes each round's seconds and tokens to ``spec["out"]``. Imports nothing of
    this project's."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True, seed=spec["seed"],
              **spec["engine_args"])
    p = spec["sampling"]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(n=p["n"], temperature=p["temperature"], top_p=p["top_p"], max_tokens=p["max_tokens"], seed=seed,
                              logprobs=0)

    llm.generate(spec["prompts"][:4], params(spec["seed"] + 10_000), use_tqdm=False)  # warm-up
    rounds = []
    for r in range(spec["rounds"]):
        # A seed per prompt, as the rollout's requests of one prompt each carry: one seed for
        # all would draw every prompt's samples from the same stream.
        rng = random.Random(spec["seed"] + r)
        per_prompt = [params(rng.randrange(2**31)) for _ in spec["prompts"]]
        began = time.monotonic()
        outputs = llm.generate(spec["prompts"], per_prompt, use_tqdm=False)
        seconds = time.monotonic() - began
        rounds.append({"seconds": seconds, "completion_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs)})
    Path(spec["out"]).write_text(json.dumps(rounds))


def saturated_vllm(model: Path, prompts: list[str], params: dict, work: Path, args: argparse.Namespace) -> list[dict]:
    from orchestrator.engine import vllm as vllm_engine

    spec, out = work / "offline.json", work / "offline.out.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "sampling": params, "seed": args.seed,
                                "rounds": args.rounds, "engine_args": args.vllm_offline_args, "out": str(out)}))
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.rollout_throughput import vllm_offline; vllm_offline({str(spec)!r})"
    log_path = work / "offline.log"
    wait_for_quiet(args.max_load, args.max_wait_s)
    console.print(f"vllm offline: {args.rounds} round(s) ...", markup=False, style="dim")
    with open(log_path, "wb") as log:
        result = subprocess.run([args.python, "-c", code], stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout_s,
                                env=vllm_engine.serve_env(gpus=(), base=python_env()))
    if result.returncode != 0:
        raise BenchError(f"vLLM offline exited with {result.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
    return [_rate(r["completion_tokens"], r["seconds"], requests=1) for r in json.loads(out.read_text())]


# -- one setting, one engine ---------------------------------------------------------------------

def pick(runs: list[dict], how: str) -> dict:
    """The round that stands for a mode: the median round by tokens/s (the lower middle one
    of an even count), or the best."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return ranked[-1] if how == "best" else ranked[(len(ranked) - 1) // 2]


def summary(rounds: dict[str, list[dict]], how: str) -> dict:
    """The picked tokens/s of each mode measured, and the rollout's ratios to the others."""
    figures = {mode: pick(runs, how)["tokens_per_s"] for mode, runs in rounds.items() if runs}
    ratios = {f"{mine}/{other}": round(figures[mine] / figures[other], 3)
              for mine in figures if mine.startswith("rollout") for other in figures if not other.startswith("rollout")}
    return {"tokens_per_s": figures, "ratios": ratios}


def lengths_summary(lengths: list[int], max_tokens: int) -> dict:
    """Completion lengths of one rollout: how far they vary."""
    return {"mean": round(statistics.fmean(lengths), 2), "min": min(lengths), "max": max(lengths),
            "p50": statistics.median(lengths), "at_max_tokens": round(sum(1 for x in lengths if x >= max_tokens) / len(lengths), 3)}


def _failure(what: str, e: Exception) -> dict:
    console.print(f"  {what} failed: {str(e).splitlines()[0][:200]}", markup=False, style="red")
    return {"what": what, "error": f"{type(e).__name__}: {e}"[-4000:]}


def bench_engine(name: str, engine: str, data: Path, args: argparse.Namespace, work: Path, prompts: dict[str, str] | None) -> tuple[dict, dict]:
    """Every mode, ``--rounds`` times, on one engine; returns (result, the prompts by task id).
    A mode that fails in a round is recorded in ``failures`` and the round goes on; raises
    BenchError when the engine does not start or the warm-up rollout fails twice."""
    from orchestrator.engine.client import EngineError
    from orchestrator.workloads.rl.workload import DEFAULT_MAX_INFLIGHT, prompts_per_request

    setting = SETTINGS[name]
    params = sampling(setting, args.n)
    python = args.python if engine == "vllm" else sys.executable
    per_request, max_inflight = prompts_per_request(engine, args.n), DEFAULT_MAX_INFLIGHT[engine]
    rounds: dict[str, list[dict]] = {"saturated": []}
    failures: list[dict] = []
    if engine == "vllm" and prompts is not None:  # before the server: the two would share the cores
        rounds["saturated"] = saturated_vllm(data / "model", [prompts[t] for t in sorted(prompts)], params, work, args)
    console.print(f"{name} / {engine}: starting the engine ...", markup=False)
    server = start_engine(engine, data / "model", work, args)
    try:
        for attempt in (1, 2):
            try:
                warm = rollout_run(python, engine, server.url, data, work / f"warm-up-{attempt}", setting, args)
                break
            except BenchError as e:
                failures.append(_failure(f"warm-up rollout {attempt}", e))
        else:
            raise BenchError("the warm-up rollout failed twice: " + failures[-1]["error"][-2000:])
        if prompts is not None and warm["prompts"] != prompts:
            raise BenchError(f"the {engine} rollout sampled other tasks than the embedded one: the two are not comparable")
        prompts = warm["prompts"]
        ids = sorted(prompts)
        texts = [prompts[t] for t in ids]
        if engine == "vllm" and not rounds["saturated"]:
            rounds["saturated"] = saturated_vllm(data / "model", texts, params, work, args)
        for r in range(args.rounds):
            load = wait_for_quiet(args.max_load, args.max_wait_s)
            console.print(f"{name} / {engine}: round {r + 1}/{args.rounds} (load {load[0]:.2f}) ...", markup=False, style="dim")
            seed = args.seed + r
            steps = [
                ("rollout", lambda: rollout_run(python, engine, server.url, data, work / f"run-{r}", setting, args)),
                ("one" if engine == "vllm" else "saturated", lambda: one_request(server.url, texts, params, seed)),
                ("requests", lambda: through_inflight(server.url, ids, texts, params, per_request=per_request,
                                                      max_sequences=max_inflight, seed=seed)),
                ("today", lambda: through_inflight(server.url, ids, texts, params, per_request=TODAY_PROMPTS_PER_REQUEST,
                                                   max_sequences=TODAY_PROMPTS_PER_REQUEST * args.n, seed=seed)),
            ]
            if args.cheap_reward and setting.overrides:
                steps.insert(1, ("rollout_exact_match", lambda: rollout_run(python, engine, server.url, data, work / f"run-{r}-exact",
                                                                              setting, args, more=(CHEAP_REWARD,))))
            for k in args.rollout_request_sizes:
                steps.append((f"rollout@{k}", lambda k=k: rollout_run(python, engine, server.url, data, work / f"run-{r}-at-{k}",
                                                                      setting, args, more=(f"rollout.prompts_per_request={k}",))))
            for k in args.request_sizes:
                steps.append((f"requests@{k}", lambda k=k: through_inflight(server.url, ids, texts, params, per_request=k,
                                                                            max_sequences=max_inflight, seed=seed)))
            for mode, measure in steps:
                try:
                    got = measure()
                except (BenchError, EngineError) as e:
                    failures.append(_failure(f"round {r + 1} {mode}", e) | {"engine_log": server.tail()})
                    continue
                if mode.startswith("rollout"):
                    got.pop("prompts")
                    got = {**got, "loadavg": load, "lengths": lengths_summary(got.pop("lengths"), setting.max_tokens)}
                rounds.setdefault(mode, []).append(got)
    except BenchError as e:
        raise BenchError(f"{name} / {engine}: {e}\nthe engine's log ends:\n{server.tail()}") from e
    finally:
        server.stop()
    rounds = {mode: runs for mode, runs in rounds.items() if runs}
    demo = json.loads((data / "demo.json").read_text()) if (data / "demo.json").exists() else {}
    result = {"data": str(data), "warm_steps": demo.get("warm_steps"), "tasks": len(prompts), "n": args.n,
              "max_tokens": setting.max_tokens, "prompts_per_request": per_request, "max_inflight": max_inflight,
              "lengths": pick(rounds["rollout"], args.pick)["lengths"] if "rollout" in rounds else None,
              **summary(rounds, args.pick), "failures": failures, "rounds": rounds}
    return result, prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="arith,chat", help=f"comma-separated, of {', '.join(SETTINGS)} (default: %(default)s)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated (default: %(default)s); vllm is left out when --python cannot import it")
    parser.add_argument("--data-path", type=Path, help="demo data for arith (default: made here)")
    parser.add_argument("--chat-data-path", type=Path, help="chat demo data for chat (default: made here)")
    parser.add_argument("--warm-steps", type=int, help="demo-data --warm-steps of data made here (default: arith 100, chat 10)")
    parser.add_argument("--tasks", type=int, default=384, help="rl.train_tasks (default: %(default)s)")
    parser.add_argument("--n", type=int, default=8, help="rl.samples_per_prompt (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode per setting and engine (default: %(default)s)")
    parser.add_argument("--pick", choices=("median", "best"), default="median", help="the round each figure comes from (default: %(default)s)")
    parser.add_argument("--cheap-reward", action="store_true",
                        help=f"where the setting has a reward of its own (chat), also the rollout with {CHEAP_REWARD}: "
                             "what the reward's CPU costs the rollout")
    parser.add_argument("--request-sizes", type=lambda t: [int(k) for k in t.split(",") if k], default=[],
                        help="also the rollout's request path with K prompts a request (comma-separated Ks), "
                             "at the rollout's in-flight budget")
    parser.add_argument("--rollout-request-sizes", type=lambda t: [int(k) for k in t.split(",") if k], default=[],
                        help="also the rollout with rollout.prompts_per_request=K (comma-separated Ks)")
    parser.add_argument("--threads", type=int, help="the embedded engine's OMP_NUM_THREADS (default: torch's own, as a rank starts it)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs vLLM (server and offline) and the rollout against it (default: this one)")
    parser.add_argument("--vllm-args", default=VLLM_SERVER_ARGS, help="appended to the vLLM server's argv (default: %(default)s)")
    parser.add_argument("--vllm-offline-args", type=json.loads, default=VLLM_OFFLINE_ARGS,
                        help="vllm.LLM keyword arguments for saturated beside dtype, enforce_eager, seed, as a JSON object "
                             f"(default: {json.dumps(VLLM_OFFLINE_ARGS)})")
    parser.add_argument("--max-load", type=float, help="wait until the 1-minute load average is below this before each round")
    parser.add_argument("--max-wait-s", type=float, default=1200.0, help="the longest such a wait (default: %(default)s)")
    parser.add_argument("--run-timeout-s", type=float, default=1200.0, help="bound on each rollout run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, help="keep the engines' logs and the runs here (default: a temp dir, removed)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [s for s in names if s not in SETTINGS] + [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown setting(s) or engine(s) {', '.join(unknown)}; settings: {', '.join(SETTINGS)}; engines: {', '.join(ENGINES)}")
    if "vllm" in engines and not has_vllm(args.python):
        err_console.print(f"{args.python} cannot import vllm (scripts/setup-vllm.sh, or --python): the embedded engine only", markup=False)
        engines.remove("vllm")

    results: dict[str, dict] = {}
    began = machine()

    def report() -> None:
        write_json(args.out, {
            "machine": began,
            "machine_after": machine(),
            "settings": {"settings": names, "engines": engines, "tasks": args.tasks, "n": args.n, "rounds": args.rounds,
                         "pick": args.pick, "threads": args.threads, "python": args.python, "vllm_args": args.vllm_args,
                         "vllm_offline_args": args.vllm_offline_args, "max_load": args.max_load, "seed": args.seed,
                         "warm_steps": args.warm_steps, "today_prompts_per_request": TODAY_PROMPTS_PER_REQUEST,
                         "cheap_reward": args.cheap_reward, "request_sizes": args.request_sizes,
                         "rollout_request_sizes": args.rollout_request_sizes},
            "results": results,
        })

    with contextlib.ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-throughput-")))
        for name in names:
            setting = SETTINGS[name]
            try:
                data = getattr(args, setting.data_option) or make_demo(setting, work / f"{name}-data", args.warm_steps or setting.warm_steps)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                err_console.print(f"{name}: making the demo data failed: {e}", markup=False)
                results[name] = {"error": str(e)}
                continue
            prompts = None
            for engine in engines:
                run_dir = work / name / engine
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    results[f"{name}/{engine}"], prompts = bench_engine(name, engine, data.resolve(), args, run_dir, prompts)
                except (BenchError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                    err_console.print(f"{name} / {engine} failed: {e}", markup=False)
                    results[f"{name}/{engine}"] = {"error": str(e)[-6000:]}
                report()

    measured = {key: r for key, r in results.items() if "error" not in r}
    present = {mode for r in measured.values() for mode in r["tokens_per_s"]}
    order = ["saturated", "one", "rollout", "rollout_exact_match", *(f"rollout@{k}" for k in args.rollout_request_sizes), "requests",
             *(f"requests@{k}" for k in args.request_sizes), "today"]
    modes = [m for m in order if m in present]
    ratios = [x for x in ("rollout/saturated", "rollout/today", "rollout_exact_match/saturated",
                          *(f"rollout@{k}/saturated" for k in args.rollout_request_sizes))
              if any(x in r["ratios"] for r in measured.values())]
    table(
        f"a rank's rollout against its engine's saturated throughput, completion tokens/s ({args.pick} of {args.rounds} rounds)",
        ["setting", "engine", "tasks x n", "max_tokens", "mean tokens", *modes, *ratios, "failures"],
        [[*key.split("/"), f"{r['tasks']} x {r['n']}", r["max_tokens"], (r["lengths"] or {}).get("mean"),
          *(r["tokens_per_s"].get(m) for m in modes), *(r["ratios"].get(x) for x in ratios), len(r["failures"])]
         for key, r in measured.items()],
        right_from=2,
    )
    failed = [key for key, r in results.items() if "error" in r or r["failures"]]
    if failed:
        err_console.print(f"failures in {', '.join(failed)}: see {args.out}", markup=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
