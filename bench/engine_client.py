"""The CPU a rollout's request to an engine costs the rank's event loop: aiohttp's session (what
the rollout sends with, ``EngineClient.async_http``) against httpx's async client spread over
256 pools (what it sent with before), in one run.

    python bench/engine_client.py                      # about 30 s
    python bench/engine_client.py --requests 3200 --in-flight 16,800

The engine is a stub in a process of its own (an asyncio server that answers every
``/v1/completions`` as the embedded engine does, a dozen sampled ids with their log-probs, after
``--delay-ms``), so
that the figure is the client's alone: each client sends ``--requests`` one-prompt requests
(the size of an agent's call, or of a multi-turn sample's later turn) with up to
``--in-flight`` at once from one event loop, and the loop's CPU seconds (``time.process_time``,
the client's process does nothing else) are divided by the requests. The two clients
alternate, ``--rounds`` times each; medians are compared.

Writes JSON (default bench/results/engine_client.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS, console, machine, python_env, table, write_json  # noqa: E402

_PROMPT = [1, 2, 3] * 60
_IDS = list(range(100, 112))
_ANSWER = {"choices": [{"index": 0, "text": " 5535</answer>", "finish_reason": "stop", "token_ids": _IDS,
                        "prompt_token_ids": _PROMPT, "stop_reason": None,
                        "logprobs": {"token_logprobs": [-0.25] * len(_IDS), "tokens": ["x"] * len(_IDS)}}]}
"""What the embedded engine answers a one-sample request of a 180-id prompt that samples a dozen ids."""


def serve(port_file: Path, delay_s: float) -> None:
    """The stub engine: answers each request on a kept-alive connection after ``delay_s``."""
    from tests import http_stub

    async def answer(body, writer):
        await asyncio.sleep(delay_s)
        return http_stub.reply(writer, _ANSWER)

    async def main():
        server = await http_stub.serve(answer)
        port_file.write_text(str(server.sockets[0].getsockname()[1]))
        await server.serve_forever()

    asyncio.run(main())


async def _httpx(client, requests: int, in_flight: int) -> None:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    pools = [httpx.AsyncClient(timeout=60, limits=limits, verify=False) for _ in range(256)]
    room = asyncio.Semaphore(in_flight)
    url = f"{client.base_url}/v1/completions"

    async def one(k: int) -> None:
        async with room:
            body = client._completion_body([_PROMPT], 1, 1.0, 1.0, 64, None, k, 1, True)
            response = await pools[k % len(pools)].post(url, json=body)
            client._completions(json.loads(client._checked("POST", url, response.status_code, response.content)), 1, 1, True)

    await asyncio.gather(*(one(k) for k in range(requests)))
    for pool in pools:
        await pool.aclose()


async def _aiohttp(client, requests: int, in_flight: int) -> None:
    room = asyncio.Semaphore(in_flight)
    async with client.async_http(60, keepalive_s=2.0) as http:
        async def one(k: int) -> None:
            async with room:
                await client.acomplete(http, [_PROMPT], n=1, max_tokens=64, seed=k, logprobs=1, return_token_ids=True)

        await asyncio.gather(*(one(k) for k in range(requests)))


CLIENTS = {"httpx, 256 pools": _httpx, "aiohttp, one session": _aiohttp}


def measure(url: str, name: str, requests: int, in_flight: int) -> float:
    """Milliseconds of CPU a request."""
    from orchestrator.engine.client import EngineClient

    client = EngineClient(url, 60, model="policy")
    began = time.process_time()
    asyncio.run(CLIENTS[name](client, requests, in_flight))
    return (time.process_time() - began) / requests * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1600)
    parser.add_argument("--in-flight", default="16,800", help="requests in flight at once, comma-separated")
    parser.add_argument("--delay-ms", type=float, default=3.0, help="the stub engine's time to answer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_client.json")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.delay_ms / 1000)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-client-") as tmp:
        port_file = Path(tmp) / "port"
        engine = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file), f"--delay-ms={args.delay_ms}"],
                                  env=python_env())
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise SystemExit("the stub engine did not start")
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            levels = [int(x) for x in args.in_flight.split(",")]
            runs = {(name, level): [] for level in levels for name in CLIENTS}
            for _ in range(args.rounds):
                for level in levels:
                    for name in CLIENTS:
                        runs[name, level].append(measure(url, name, args.requests, level))
        finally:
            engine.kill()
            engine.wait()
    median = {key: statistics.median(ms) for key, ms in runs.items()}
    rows, ratios = [], {}
    for level in levels:
        base, new = median["httpx, 256 pools", level], median["aiohttp, one session", level]
        ratios[level] = base / new
        for name in CLIENTS:
            rows.append([str(level), name, ", ".join(f"{ms:.3f}" for ms in runs[name, level]), f"{median[name, level]:.3f}"])
    table(f"CPU of the event loop a request, ms ({args.requests} requests)", ["in flight", "client", "each round", "median"], rows)
    for level, ratio in ratios.items():
        console.print(f"{level} in flight: aiohttp takes {1 / ratio:.2f}x httpx's CPU a request ({ratio:.1f}x less)")
    write_json(args.out, {"machine": machine(), "requests": args.requests, "delay_ms": args.delay_ms,
                          "ms_per_request": {f"{name} @ {level}": ms for (name, level), ms in runs.items()},
                          "httpx_over_aiohttp": {str(k): v for k, v in ratios.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
