"""Partial rollouts against the long tail: the rollout phase's seconds with and without
``rollout.partial``, the tokens generated and the tokens thrown away, in one run.

    python bench/partial.py                      # ~3 min on 2 cores
    python bench/partial.py --iterations 6 --tasks 128

Two parts, each mode after the other on fresh log paths:

tail   ``orchestrator run`` on one rank, rollout only (``--rl-phase rollout --rollout-split
       train-only``, ``--debug-mode``), against a heavy-tailed engine this script serves: each
       sample is ``--median`` tokens (0.5x to 1.5x, uniform) or, for ``--tail-fraction`` of them,
       ``--tail-factor`` times that, one token every ``--token-s`` seconds, every sequence at once
       (an engine that is never the bottleneck: the phase lasts as long as its longest sample).
       It pauses (aborts) and resumes as vLLM does, answering a stopped sample with the tokens it
       had; a continued one (a token-id prompt) goes on to the length it was drawn with. Modes:
       ``off``, ``partial`` (``rollout.oversample`` ``--oversample``, ``rollout.max_carry`` 1) and
       ``partial-carry2`` (``rollout.max_carry`` 2).
chat   the chat demo (``demo-data --chat``) trained for real on one rank, with a long tail of its
       own: ``rl.temperature`` ``--chat-temperature`` (2.5: a median of 14 tokens, 5% past 52,
       the longest at the limit) and ``rl.max_tokens`` ``--chat-max-tokens``,
       ``--chat-tasks`` train tasks (the engine samples every sequence at once), a prompt a
       request (``rollout.prompts_per_request`` 1, as vLLM's default); ``off`` and ``partial``.

The rollout phase is the master's phases 1 and 2 (rollout, then the sealed shards). Tokens
generated: every token the engine sampled (the tail engine counts them; in the chat part, the
sampled tokens of every record of the pools, which a continued sample holds once). Thrown away:
the tokens of groups dropped at the staleness bound (the iteration summaries' ``partial``).
Writes JSON (default bench/results/partial.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, BenchError, machine, python_env, run_iterations, table, write_json  # noqa: E402

DEFAULT_OUT = RESULTS / "partial.json"
ROLLOUT = ("1:rollout", "2:rollout_done")
PROMPT_IDS = [1, 2, 3]
LENGTH_BASE = 1000
"""A sampled token's id is LENGTH_BASE + the sample's drawn length: a continued sample's prompt
says how long it was drawn to be, and how far it got."""


class TailEngine(ThreadingHTTPServer):
    """The heavy-tailed engine (see the module's docstring), on a port of 127.0.0.1."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, *, median: int, tail_fraction: float, tail_factor: float, token_s: float):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.median, self.tail_fraction, self.tail_factor, self.token_s = median, tail_fraction, tail_factor, token_s
        self.lock = threading.Lock()
        self.resumed = threading.Event()
        self.resumed.set()
        self.running: set[threading.Event] = set()  # each request's stop
        self.tokens = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def length(self, rng: random.Random) -> int:
        if rng.random() < self.tail_fraction:
            return round(self.median * self.tail_factor)
        return max(1, round(self.median * rng.uniform(0.5, 1.5)))


class _Handler(BaseHTTPRequestHandler):
    server: TailEngine

    def do_GET(self) -> None:
        s = self.server
        if self.path == "/health":
            self._send(None)
        elif self.path == "/v1/models":
            self._send({"object": "list", "data": [{"id": "tail", "object": "model"}]})
        elif self.path == "/is_paused":
            self._send({"is_paused": not s.resumed.is_set()})
        elif self.path == "/stats":
            self._send({"tokens": s.tokens})
        else:
            self._send({"error": {"message": f"no route {self.path}"}}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        s = self.server
        route = self.path.split("?")[0]
        if route == "/pause":
            with s.lock:
                s.resumed.clear()
                for stop in s.running:
                    stop.set()
            self._send({})
        elif route == "/resume":
            s.resumed.set()
            self._send({})
        elif route == "/v1/completions":
            self._complete(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        else:
            self._send({"error": {"message": f"no route {self.path}"}}, HTTPStatus.NOT_FOUND)

    def _complete(self, body: dict) -> None:
        s = self.server
        s.resumed.wait()  # a request sent while paused waits for the resume
        n, limit = body.get("n") or 1, body["max_tokens"]
        plan = []  # (prompt index, sample, drawn length, tokens it had, tokens it may have now)
        for j, prompt in enumerate(body["prompt"]):
            for i in range(n):
                had = prompt[len(PROMPT_IDS):] if isinstance(prompt, list) else []
                if had:  # a continued sample: its drawn length and progress are in its ids
                    length = had[0] - LENGTH_BASE
                else:
                    length = s.length(random.Random(f"{prompt}:{body.get('seed')}:{i}"))
                plan.append((j, i, length, len(had), min(length - len(had), limit)))
        stop = threading.Event()
        with s.lock:
            s.running.add(stop)
        began = time.monotonic()
        try:
            stop.wait(max(p[4] for p in plan) * s.token_s)
        finally:
            with s.lock:
                s.running.discard(stop)
        done_steps = int((time.monotonic() - began) / s.token_s)
        choices = []
        for j, i, length, had, wanted in plan:
            made = min(wanted, done_steps)
            reason = "abort" if made < wanted else "stop" if had + made >= length else "length"
            ids = [LENGTH_BASE + length] * made
            with s.lock:
                s.tokens += made
            choices.append({"index": j * n + i, "text": "x" * made, "finish_reason": reason, "token_ids": ids,
                            "prompt_token_ids": PROMPT_IDS, "logprobs": {"token_logprobs": [-0.1] * made, "tokens": ["x"] * made}})
        self._send({"id": "tail", "object": "text_completion", "model": "tail", "choices": choices})

    def _send(self, payload, status: HTTPStatus = HTTPStatus.OK) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:
        pass


def _summaries(log_path: Path, iterations: int) -> list[dict]:
    return [json.loads((log_path / "iterations" / f"{i:06d}" / "summary.json").read_text()) for i in range(1, iterations + 1)]


def _dropped(log_path: Path, iterations: int) -> int:
    return sum((s.get("partial") or {}).get("tokens_dropped", 0) for s in _summaries(log_path, iterations))


def _mode_flags(mode: str, oversample: float) -> list[str]:
    if mode == "off":
        return []
    return ["rollout.partial=true", f"rollout.oversample={oversample}", f"rollout.max_carry={2 if mode.endswith('carry2') else 1}"]


def tail_mode(mode: str, data: Path, work: Path, args: argparse.Namespace) -> dict:
    engine = TailEngine(median=args.median, tail_fraction=args.tail_fraction, tail_factor=args.tail_factor, token_s=args.token_s)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        log_path = work / f"tail-{mode}"
        argv = [sys.executable, "-m", "orchestrator", "run", "--master", f"--data-path={data}", f"--log-path={log_path}",
                "--rl-phase=rollout", "--rollout-split=train-only", f"--max-iterations={args.iterations}", "--debug-mode",
                f"rollout.engine_url={engine.url}", f"rl.train_tasks={args.tasks}", f"rl.samples_per_prompt={args.samples}",
                f"rl.max_tokens={round(args.median * args.tail_factor)}", "rollout.prompts_per_request=1",
                *_mode_flags(mode, args.oversample)]
        _wall, done = run_iterations(argv, log_path, iterations=args.iterations, env=python_env(), timeout_s=args.timeout_s,
                                     what=f"tail {mode}")
        tokens = engine.tokens
    finally:
        engine.shutdown()
        engine.server_close()
    rollout = [sum(it["timing"]["phases"].get(label, 0.0) for label in ROLLOUT) for it in done]
    return {"part": "tail", "mode": mode, "rollout_s": [round(s, 3) for s in rollout], "mean_rollout_s": round(statistics.mean(rollout), 3),
            "trained_groups": [it["trajectories"] // args.samples for it in done], "tokens": tokens,
            "tokens_dropped": _dropped(log_path, args.iterations)}


def chat_mode(mode: str, data: Path, work: Path, args: argparse.Namespace) -> dict:
    log_path = work / f"chat-{mode}"
    argv = [sys.executable, "-m", "orchestrator", "run", "--master", f"--data-path={data}", f"--log-path={log_path}",
            "--rl-phase=both", f"--eval-interval={args.chat_iterations}", f"--max-iterations={args.chat_iterations}",
            f"rl.train_tasks={args.chat_tasks}", f"rl.max_tokens={args.chat_max_tokens}", f"rl.temperature={args.chat_temperature}",
            "rollout.prompts_per_request=1", *_mode_flags(mode, args.oversample)]
    _wall, done = run_iterations(argv, log_path, iterations=args.chat_iterations, env=python_env(), timeout_s=args.timeout_s,
                                 what=f"chat {mode}")
    rollout = [sum(it["timing"]["phases"].get(label, 0.0) for label in ROLLOUT) for it in done]
    # Every token sampled is in one train aggregate, in the last carry aggregate, or thrown away.
    last = log_path / "iterations" / f"{args.chat_iterations:06d}" / "aggregate" / "carry.jsonl"
    files = [log_path / "iterations" / f"{i:06d}" / "aggregate" / "train.jsonl" for i in range(1, args.chat_iterations + 1)]
    dropped = _dropped(log_path, args.chat_iterations)
    tokens = dropped + sum(len(s.get("token_ids") or ()) for f in files + ([last] if last.exists() else [])
                           for line in f.read_text().splitlines() for s in json.loads(line)["samples"])
    return {"part": "chat", "mode": mode, "rollout_s": [round(s, 3) for s in rollout], "mean_rollout_s": round(statistics.mean(rollout), 3),
            "trained_groups": [it["trajectories"] // 8 for it in done], "tokens": tokens, "tokens_dropped": dropped,
            "response_length": [round((it.get("update") or {}).get("response_length") or 0, 2) for it in done]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=64, help="rl.train_tasks of the tail part")
    parser.add_argument("--samples", type=int, default=4, help="rl.samples_per_prompt of the tail part")
    parser.add_argument("--median", type=int, default=8, help="the tail engine's median sample length, tokens")
    parser.add_argument("--tail-fraction", type=float, default=0.05)
    parser.add_argument("--tail-factor", type=float, default=10.0)
    parser.add_argument("--token-s", type=float, default=0.05, help="the tail engine's seconds a token")
    parser.add_argument("--oversample", type=float, default=0.5)
    parser.add_argument("--chat-iterations", type=int, default=6)
    parser.add_argument("--chat-tasks", type=int, default=64, help="rl.train_tasks of the chat part")
    parser.add_argument("--chat-max-tokens", type=int, default=96)
    parser.add_argument("--chat-temperature", type=float, default=2.5)
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-partial-") as tmp:
        work = Path(tmp)
        data = work / "chat"
        made = subprocess.run([sys.executable, "-m", "orchestrator", "demo-data", "--chat", f"--data-path={data}"],
                              capture_output=True, text=True, env=python_env())
        if made.returncode:
            raise BenchError(f"demo-data --chat failed: {made.stderr[-2000:]}")
        for mode in ("off", "partial", "partial-carry2"):
            results.append(tail_mode(mode, data, work, args))
        if not args.skip_chat:
            for mode in ("off", "partial"):
                results.append(chat_mode(mode, data, work, args))
    base = {r["part"]: r for r in results if r["mode"] == "off"}
    rows = []
    for r in results:
        r["mean_rollout_s_after_first"] = round(statistics.mean(r["rollout_s"][1:]), 3)  # the first starts the engine
        r["ratio"] = round(r["mean_rollout_s"] / base[r["part"]]["mean_rollout_s"], 3)
        r["ratio_after_first"] = round(r["mean_rollout_s_after_first"] / base[r["part"]]["mean_rollout_s_after_first"], 3)
        r["dropped_fraction"] = round(r["tokens_dropped"] / r["tokens"], 4) if r["tokens"] else 0.0
        rows.append([r["part"], r["mode"], f"{r['mean_rollout_s']:.2f}", f"{r['ratio']:.2f}x", f"{r['ratio_after_first']:.2f}x",
                     " ".join(map(str, r["trained_groups"])),
                     str(r["tokens"]), f"{r['tokens_dropped']} ({100 * r['dropped_fraction']:.1f}%)"])
    table("rollout phase (phases 1-2), mean over iterations",
          ["part", "mode", "rollout s", "vs off", "vs off, iterations 2+", "groups trained", "tokens generated", "thrown away"], rows)
    write_json(args.out, {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                          "results": results})


if __name__ == "__main__":
    main()
