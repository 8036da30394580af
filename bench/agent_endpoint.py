"""Eval of the tool demo through the agent endpoint against the same eval on the native
environment path, in one run: the sampled tokens a second of each.

    python bench/agent_endpoint.py                    # about 5 minutes on 2 cores
    python bench/agent_endpoint.py --rounds 1 --data /tmp/orch-tools

Both paths evaluate the tool demo's base model (``demo-data --tools``, made here unless
``--data`` names one) on the same eval tasks and samples a task, one rank, the embedded engine
(the draws differ: a task's first turns are one request on the environment path, one call a
sample through the endpoint):

- ``native``: the calculator environment (``orchestrator.demo.calculator:Calculator``), each
  turn a request of the rollout's, the environment's step in the rank's threads;
- ``endpoint``: the same calculator as an agent written with the ``openai`` client
  (examples/agents/calculator_agent.py, ``rl.agent``): every model call a request to the
  rank's agent endpoint, rendered there by the chat template, its tool calls parsed (hermes);
  the example's client (orchestrator.agents.clients) calls the endpoint's app in-process;
- ``endpoint-http``: the same agent with its client over HTTP to the endpoint.

Each run is ``orchestrator run --rl-phase rollout --rollout-split eval-only --max-iterations 1``:
the base model's eval alone. The figure is the eval's ``tokens_per_s`` (tokens the model sampled, over the span
of the eval's requests; status --json and metrics.jsonl have it), with the eval phase's
seconds beside it; the paths alternate, ``--rounds`` times each, and the median of each is
compared. Eval accuracy is printed too: the two paths sample the same policy, so it should
agree within the draws' noise. So are the engine's requests, its rows' prompt tokens and the
tokens its prefills ran (a prompt that several rows continue runs once: a request's ``n``, or
the same prompt in requests admitted together, as a group's agents send their first calls),
from the counters it logs when it stops.

Writes JSON (default bench/results/agent_endpoint.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, RESULTS, BenchError, console, machine, python_env, run_iterations, table, write_json  # noqa: E402
from orchestrator.demo import TOOLS_MAX_TOKENS  # noqa: E402
from orchestrator.engine.server import STATS_AT_EXIT  # noqa: E402

PATHS = {
    "native": ["rl.max_turns=3"],
    "endpoint": ["rl.agent=calculator_agent:solve"],
    "endpoint-http": ["rl.agent=calculator_agent_http:solve"],
}
HTTP_AGENT = """
import functools

import calculator_agent
from calculator_agent import solve
from orchestrator.agents import clients

calculator_agent.client = functools.partial(clients.client, in_process=False)
"""
"""The example agent with its client over HTTP to the endpoint (the helper's in-process route off)."""


def tool_demo(data: Path | None, work: Path) -> Path:
    if data is not None:
        return data
    data = work / "data"
    console.print(f"making the tool demo's data in {data} ...")
    subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", "--tools", f"--data-path={data}"], check=True,
                   env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return data


def measure(path: str, data: Path, log: Path, eval_tasks: int, timeout_s: float) -> dict:
    env = python_env()
    (log.parent / "calculator_agent_http.py").write_text(HTTP_AGENT)
    env["PYTHONPATH"] = f"{REPO / 'examples' / 'agents'}:{log.parent}:{env['PYTHONPATH']}"
    argv = [sys.executable, "-m", "orchestrator", "run", f"--data-path={data}", f"--log-path={log}", "--rl-phase=rollout",
            "--rollout-split=eval-only", "--max-iterations=1", "--eval-interval=1", f"rl.max_tokens={TOOLS_MAX_TOKENS}",
            f"rl.eval_tasks={eval_tasks}", *PATHS[path]]
    _, iterations = run_iterations(argv, log, iterations=1, env=env, timeout_s=timeout_s, what=path)
    lines = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not lines:
        raise BenchError(f"{path}: no eval metrics in {log / 'metrics.jsonl'}")
    found = lines[-1]
    phases = (iterations[0]["timing"] or {}).get("phases") or {}
    engine = engine_stats(log)
    return {"tokens_per_s": found["tokens_per_s"], "accuracy": found["accuracy"], "response_length": found["response_length"],
            "turns": found.get("turns"), "eval_s": next((s for name, s in phases.items() if name.endswith(":eval")), None),
            "requests": engine["requests"], "prompt_tokens": engine["prompt_tokens"], "prefill_tokens": engine["prefill_tokens"]}


def engine_stats(log: Path) -> dict:
    """The rank's engine's counters as it logged them when it stopped (``stats at exit:``)."""
    engine_log = log / "engines" / "r00000" / "engine0.log"
    for line in reversed(engine_log.read_text().splitlines()):
        if STATS_AT_EXIT in line:
            return json.loads(line.split(STATS_AT_EXIT, 1)[1])
    raise BenchError(f"no '{STATS_AT_EXIT}' line in {engine_log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="the tool demo's data folder (made here when not given)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each path, alternating")
    parser.add_argument("--eval-tasks", type=int, default=200)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS / "agent_endpoint.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        work = Path(tmp)
        data = tool_demo(args.data, work)
        runs: dict[str, list[dict]] = {p: [] for p in PATHS}
        for r in range(args.rounds):
            for path in PATHS:
                console.print(f"round {r + 1}: {path} ...")
                runs[path].append(measure(path, data, work / f"{path}-{r}", args.eval_tasks, args.timeout_s))
    median = {p: statistics.median(run["tokens_per_s"] for run in rs) for p, rs in runs.items()}
    ratio = median["endpoint"] / median["native"]
    http_ratio = median["endpoint-http"] / median["native"]
    table("eval of the tool demo: sampled tokens a second", ["path", "tokens/s (each run)", "median", "eval phase s", "eval accuracy",
                                                            "turns", "engine requests", "prompt tokens", "prefilled"],
          [[p, ", ".join(f"{run['tokens_per_s']:.0f}" for run in rs), f"{median[p]:.0f}",
            ", ".join(f"{run['eval_s']:.1f}" for run in rs if run["eval_s"] is not None),
            ", ".join(f"{run['accuracy']:.3f}" for run in rs), f"{rs[0]['turns']:.2f}" if rs[0]["turns"] else "-",
            f"{rs[0]['requests']:,}", f"{rs[0]['prompt_tokens']:,}", f"{rs[0]['prefill_tokens']:,}"]
           for p, rs in runs.items()])
    console.print(f"endpoint over native: {ratio:.2f}x (over HTTP: {http_ratio:.2f}x)", markup=False)
    write_json(args.out, {"machine": machine(), "eval_tasks": args.eval_tasks, "runs": runs, "median_tokens_per_s": median,
                          "endpoint_over_native": ratio, "endpoint_http_over_native": http_ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
