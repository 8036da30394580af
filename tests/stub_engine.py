"""A stub inference engine for tests: a real HTTP server process that speaks the rollout's
subset of vLLM's API and answers every completion request after a fixed delay, counting the
sequences (prompts x n) it holds at once.

    python -m tests.stub_engine --port-file F [--delay-s 0.3] [--model NAME]

``GET /stats`` answers ``{"in_flight": ..., "peak_sequences": ..., "requests": ...}``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address, delay_s: float, model: str):
        super().__init__(address, _Handler)
        self.delay_s, self.model = delay_s, model
        self.lock = threading.Lock()
        self.in_flight = self.peak = self.requests = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(HTTPStatus.OK, None)
        elif self.path == "/v1/models":
            self._send(HTTPStatus.OK, {"object": "list", "data": [{"id": self.server.model, "object": "model"}]})
        elif self.path == "/stats":
            s = self.server
            with s.lock:
                self._send(HTTPStatus.OK, {"in_flight": s.in_flight, "peak_sequences": s.peak, "requests": s.requests})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._send(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        n = body.get("n") or 1
        s = self.server
        with s.lock:
            s.in_flight += len(prompts) * n
            s.peak = max(s.peak, s.in_flight)
            s.requests += 1
        try:
            time.sleep(s.delay_s)
        finally:
            with s.lock:
                s.in_flight -= len(prompts) * n
        choices = [{"index": j * n + i, "text": "7", "finish_reason": "stop", "token_ids": [7, 2],
                    "prompt_token_ids": [1, 5, 6], "logprobs": {"token_logprobs": [-0.5, -0.1], "tokens": ["7", "</s>"]}}
                   for j in range(len(prompts)) for i in range(n)]
        self._send(HTTPStatus.OK, {"id": "stub", "object": "text_completion", "model": s.model, "choices": choices})

    def _send(self, status: HTTPStatus, payload) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--delay-s", type=float, default=0.3)
    parser.add_argument("--model", default="stub")
    args = parser.parse_args()
    server = _Server(("127.0.0.1", 0), args.delay_s, args.model)
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.replace(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
