"""The embedded inference engine: its own process, serving the subset of vLLM's
OpenAI-compatible HTTP API that the rollout uses, so that the rollout talks to it exactly as
it talks to vLLM.

    python -m orchestrator.engine.server --model DIR --port P [--host 127.0.0.1] [--served-model-name NAME]
        [--max-num-seqs N] [--device cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16]

The model is loaded first (engine/loading.py: safetensors only, any architecture transformers knows) and put on
``--device`` in ``--dtype`` (default: the CPU, and ``auto``: the checkpoint's own dtype,
float32 for the demo's); the sampler makes every tensor there, its generators included. A
``--device`` this torch cannot use ends the process with status 2. Then the port is bound
and one line ``listening on http://HOST:PORT`` is logged (``--port 0`` lets the OS pick the
port, and that line says which). From then on ``GET /health`` answers 200.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (non-streaming),
and ``GET /stats`` (this engine's own: the scheduler's counters, ``scheduler.Stats``). A request
that cannot be served as asked gets a 400 rather than a silent approximation: unknown
fields, ``stream`` and ``echo`` included. A prompt is text, or token ids (a list of them for
several prompts), continued as they are, as vLLM does: what a multi-turn rollout sends, so
that nothing it sampled is tokenized again. vLLM's ``prompt_logprobs`` (k, 0 to 20) scores the
prompt itself: each choice's ``prompt_logprobs`` has ``None`` for the first token, then for each
later one a dict from token id (a string) to ``{"logprob", "rank", "decoded_token"}``: the prompt's
own token and the k most likely there, under the raw model distribution, computed on the
prefill (``max_tokens`` 1 is the cheapest such request; 0 is refused, as vLLM refuses it without
``echo``). SIGTERM or SIGINT stops the
server and the process exits 0. One log line per request goes to stderr; a completion's
line also gives ``batch_requests``: the most requests that decoded in one step with it,
itself included.

Requests are batched together as vLLM batches them (``orchestrator/engine/scheduler.py``):
the sequences of a request that arrives while others decode join the running batch at the
next step, up to ``--max-num-seqs`` sequences, and each request is answered as soon as its
own sequences have ended. Requests admitted together with the same prompt ids share one
prefill, as a request's ``n`` samples do (a group's samples sent one request each, as agents
send them through the agent endpoint: what vLLM's prefix cache spares them); ``GET /stats``
counts the rows' prompt tokens and the tokens prefilled, and a stopped server logs its
counters last (``stats at exit: {...}``).

``POST /reload`` with ``{"model": DIR, "served_model_name": NAME}`` moves the running server
to another checkpoint of the same architecture, in place (the counterpart of vLLM's
``reload_weights``): the requests queued before it finish on the old weights, new ones wait
while the batch drains, DIR's safetensors are copied into the loaded model, and from then on
the server answers to NAME only, so that a client still asking for the old name gets a 404
instead of the new policy's samples. A checkpoint that does not fit (another architecture,
missing tensors) is a 400 and the old one serves on.

``POST /pause`` and ``POST /resume`` (and ``GET /is_paused``) are vLLM's: a pause answers every
request not answered yet with what it has sampled, finish reason ``abort`` (with
``?wait_for_inflight_requests=true`` the running ones finish instead), and requests wait
until the resume (``scheduler.Scheduler.pause``).

LoRA (``--base-model BASE``): ``--model`` and a reload's DIR may be an adapter directory
(peft's ``adapter_config.json`` and ``adapter_model.safetensors``, as the trainer writes with
``train.lora_rank``). The server loads BASE once and merges each adapter into it in place
(``orchestrator/engine/lora.py``): a reload reads megabytes and never the base again.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from orchestrator.node import collector

if __name__ == "__main__":  # the process's entry, before the heavy imports: orchestrator/node/collector.py
    collector.tune()

from orchestrator import checkpoints
from orchestrator.checkpoints import sums
from orchestrator.engine import loading, lora
from orchestrator.engine.sampling import Generation, PromptLogprobs, PromptRejected, Sampler, SamplingParams
from orchestrator.engine.scheduler import EngineStopped, Scheduler
from orchestrator.errors import EXIT_BAD_INPUT
from orchestrator.protocol import child_error, fsio

log = logging.getLogger("orchestrator.engine.server")

_LOGPROB_FLOOR = -9999.0  # what vLLM sends instead of -inf, which JSON cannot carry
_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_NUM_SEQS = 4096
"""Above what a rollout keeps in flight, so that the client decides how much work a step gets."""
_SCHEDULER_STOP_S = 2.0  # how long a stop waits for the step in progress
DTYPES = ("auto", "float32", "bfloat16")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class DeviceUnavailable(Exception):
    """``--device`` names a GPU that this torch cannot use; the message says why."""


class RequestRejected(Exception):
    """The request cannot be served; ``status`` and ``kind`` go into the error response."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


Prompt = str | list[int]
"""A prompt as text, or as token ids the engine continues as they are (a multi-turn rollout's
context: never re-tokenized)."""


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompts: list[Prompt]
    params: SamplingParams
    return_token_ids: bool


_RELOAD_FIELDS = frozenset({"model", "served_model_name"})

_FIELDS = frozenset(
    {"model", "prompt", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs", "prompt_logprobs",
     "return_token_ids"}
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, name: str, default, check, expected: str, *, nullable: bool = True):
    """``body[name]``, or ``default`` when absent (or null, where null means the default)."""
    if name not in body or (nullable and body[name] is None):
        return default
    value = body[name]
    if not check(value):
        raise RequestRejected(f"'{name}' must be {expected}, got {json.dumps(value)}")
    return value


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


def _prompts(prompt) -> list[Prompt]:
    """As OpenAI's and vLLM's completions API take them: a string, a list of strings, a list of
    token ids (one prompt), or a list of such lists."""
    if isinstance(prompt, str):
        return [prompt]
    if _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(_token_ids(p) for p in prompt)):
        return prompt
    raise RequestRejected("'prompt' must be a string, a list of strings, a list of token ids (non-negative integers), or a "
                          f"non-empty list of such lists, got {json.dumps(prompt)[:200]}")


def parse_completion_request(body, served_model_name: str) -> CompletionRequest:
    """The request's prompts and sampling settings; raises RequestRejected (400 or 404)."""
    if not isinstance(body, dict):
        raise RequestRejected("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestRejected(
            f"unsupported field(s): {', '.join(unknown)}; this engine accepts {', '.join(sorted(_FIELDS))}"
        )
    model = _field(body, "model", None, lambda v: isinstance(v, str), "a string")
    if model is not None and model != served_model_name:
        raise RequestRejected(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "NotFoundError")
    if "prompt" not in body:
        raise RequestRejected("'prompt' is required")
    prompts = _prompts(body["prompt"])
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestRejected(f"'stop' must be a string, a list of strings or null, got {json.dumps(stop)}")
    try:
        params = SamplingParams(
            n=_field(body, "n", 1, _is_int, "an integer", nullable=False),
            temperature=float(_field(body, "temperature", 1.0, _is_number, "a number")),
            top_p=float(_field(body, "top_p", 1.0, _is_number, "a number")),
            max_tokens=_field(body, "max_tokens", 16, _is_int, "an integer", nullable=False),
            stop=tuple(stop),
            seed=_field(body, "seed", None, _is_int, "an integer or null"),
            logprobs=_field(body, "logprobs", None, _is_int, "an integer or null"),
            prompt_logprobs=_field(body, "prompt_logprobs", None, _is_int, "an integer or null"),
        )
    except ValueError as e:
        raise RequestRejected(str(e)) from e
    return_token_ids = _field(body, "return_token_ids", None, lambda v: isinstance(v, bool), "a boolean or null")
    return CompletionRequest(prompts, params, bool(return_token_ids))


def token_strings(request: CompletionRequest, generation: Generation, sampler: Sampler) -> dict[int, str]:
    """How vLLM names each token the response's logprobs mention (none when not asked): the
    tokenizer's work of :func:`completion_response`, for the thread that owns the tokenizer."""
    ids = set()
    if request.params.logprobs is not None:
        ids.update(t for samples in generation.samples for sample in samples for t in sample.token_ids)
    if request.params.logprobs:
        ids.update(alt for samples in generation.samples for sample in samples
                   for alternatives in sample.top_logprobs for alt, _ in alternatives)
    for prompt_ids, scored in zip(generation.prompt_token_ids, generation.prompt_logprobs or ()):
        ids.update(prompt_ids[1:])
        ids.update(alt for alternatives in scored.top for alt, _ in alternatives)
    return {t: sampler.token_string(t) for t in ids}


def prompt_logprobs(prompt_ids: list[int], scored: PromptLogprobs, token_string: dict[int, str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of one prompt: None for its first token (nothing before it to
    score it), then the token itself first and the k most likely after it, keyed by token id."""
    positions: list[dict | None] = [None]
    for t, lp, rank, alternatives in zip(prompt_ids[1:], scored.token_logprobs, scored.ranks, scored.top, strict=True):
        step = {str(t): {"logprob": max(lp, _LOGPROB_FLOOR), "rank": rank, "decoded_token": token_string[t]}}
        for i, (alt, alt_lp) in enumerate(alternatives):
            step.setdefault(str(alt), {"logprob": max(alt_lp, _LOGPROB_FLOOR), "rank": i + 1, "decoded_token": token_string[alt]})
        positions.append(step)
    return positions


def completion_response(request: CompletionRequest, generation: Generation, token_string: dict[int, str],
                        model_name: str) -> dict:
    """The OpenAI ``text_completion`` object, shaped as vLLM shapes it; ``token_string`` names
    the tokens its logprobs mention (:func:`token_strings`)."""
    choices = []
    completion_tokens = 0
    for j, samples in enumerate(generation.samples):
        scored = None
        if generation.prompt_logprobs is not None:  # the same list in each of the prompt's choices, as vLLM sends it
            scored = prompt_logprobs(generation.prompt_token_ids[j], generation.prompt_logprobs[j], token_string)
        for sample in samples:
            logprobs = None
            if request.params.logprobs is not None:
                tokens = [token_string[t] for t in sample.token_ids]
                offsets, at = [], 0
                for token in tokens:
                    offsets.append(at)
                    at += len(token)
                top = []
                for t, lp, alternatives in zip(sample.token_ids, sample.token_logprobs, sample.top_logprobs):
                    # As vLLM does: the sampled token first, then the k most likely.
                    step = {token_string[t]: max(lp, _LOGPROB_FLOOR)}
                    for alt, alt_lp in alternatives:
                        step.setdefault(token_string[alt], max(alt_lp, _LOGPROB_FLOOR))
                    top.append(step)
                logprobs = {
                    "tokens": tokens,
                    "token_logprobs": [max(lp, _LOGPROB_FLOOR) for lp in sample.token_logprobs],
                    "top_logprobs": top,
                    "text_offset": offsets,
                }
            choices.append(
                {
                    "index": len(choices),
                    "text": sample.text,
                    "logprobs": logprobs,
                    "finish_reason": sample.finish_reason.value,
                    "stop_reason": sample.stop_reason,
                    "prompt_logprobs": scored,
                    "prompt_token_ids": generation.prompt_token_ids[j] if request.return_token_ids else None,
                    "token_ids": sample.token_ids if request.return_token_ids else None,
                }
            )
            completion_tokens += len(sample.token_ids)
    prompt_tokens = sum(len(ids) for ids in generation.prompt_token_ids)  # once per prompt, not per sample
    return {
        "id": f"cmpl-{random.getrandbits(128):032x}",  # as uuid4().hex, without a system call per response
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def error_body(message: str, status: HTTPStatus, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": int(status)}}


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # an in-flight request does not hold up shutdown
    request_queue_size = 1024  # the listen backlog: a rollout opens hundreds of connections at once (the default 5 resets them)

    def __init__(self, address: tuple[str, int], scheduler: Scheduler, model_name: str, model_dir: str):
        super().__init__(address, _Handler)
        self.scheduler = scheduler
        self.sampler = scheduler.sampler
        self.model_name = model_name
        """Written on the scheduler thread only (by a reload, between two steps)."""
        self.model_dir = model_dir
        self.created = int(time.time())
        self.adapters = lora.Merger(self.sampler.model)
        """The base's own weights under the adapter served (--base-model); used on the scheduler thread only."""


class _CompletionJob:
    """A completion request as the scheduler runs it (scheduler.Job): both methods run on the
    scheduler thread, which owns the model and the tokenizer. They do as little as they can,
    since every step waits for them: the handler thread builds the response."""

    def __init__(self, server: EngineHTTPServer, body: dict, request: CompletionRequest):
        self.server, self.body, self.request = server, body, request
        self.prompts, self.params = request.prompts, request.params
        self.model_name = server.model_name

    def admit(self) -> None:
        # Checked again: a reload may have renamed the policy while this request was queued.
        parse_completion_request(self.body, self.server.model_name)
        self.model_name = self.server.model_name

    def finish(self, generation: Generation) -> tuple[Generation, dict[int, str]]:
        return generation, token_strings(self.request, generation, self.server.sampler)


class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer
    server_version = "orchestrator-engine"
    # Keep-alive: a rollout sends hundreds of small requests, and a connection each would cost
    # a handshake and a thread start every time. Every response carries its Content-Length,
    # and every request's body is read off the socket, or the connection is closed.
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave in two writes: Nagle would hold the body for the client's delayed ACK (40 ms)
    timeout = 600.0  # an idle kept-alive connection's thread ends after this long without a request

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        started = time.monotonic()
        routes = {
            "/health": ("GET", self._health),
            "/stats": ("GET", self._stats),
            "/v1/models": ("GET", self._models),
            "/v1/completions": ("POST", self._completions),
            "/reload": ("POST", self._reload),
            "/pause": ("POST", self._pause),
            "/resume": ("POST", self._resume),
            "/is_paused": ("GET", self._is_paused),
        }
        path = self.path.split("?", 1)[0]
        detail = ""
        self._body: bytes | None = None
        try:
            self._body = self._read_body()
            if path not in routes:
                raise RequestRejected(f"no route {method} {path}", HTTPStatus.NOT_FOUND, "NotFoundError")
            allowed, handler = routes[path]
            if method != allowed:
                raise RequestRejected(f"{path} takes {allowed}", HTTPStatus.METHOD_NOT_ALLOWED, "MethodNotAllowed")
            status, payload, detail = handler()
        except RequestRejected as e:
            status, payload, detail = e.status, error_body(str(e), e.status, e.kind), str(e)
        except Exception as e:
            log.exception("%s %s failed", method, path)
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            payload = error_body(f"{type(e).__name__}: {e}", status, "InternalServerError")
            detail = "internal error"
        body = b"" if payload is None else json.dumps(payload, allow_nan=False).encode()
        try:
            self.send_response(status)
            if payload is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            detail = f"{detail} (client went away before the response)".strip()
        log.info(
            "%s %s %s %d %.3fs%s",
            self.client_address[0], method, path, status, time.monotonic() - started, f" {detail}" if detail else ""
        )

    def _health(self):
        return HTTPStatus.OK, None, ""

    def _stats(self):
        return HTTPStatus.OK, dataclasses.asdict(self.server.scheduler.stats()), ""

    def _models(self):
        card = {
            "id": self.server.model_name,
            "object": "model",
            "created": self.server.created,
            "owned_by": "orchestrator",
            "root": self.server.model_dir,
            "parent": None,
            "max_model_len": self.server.sampler.max_model_len,
        }
        return HTTPStatus.OK, {"object": "list", "data": [card]}, ""

    def _read_body(self) -> bytes | None:
        """The request's body, read whatever the route (the connection is kept alive); None
        without a Content-Length. A body this server will not read closes the connection."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise RequestRejected("a chunked body is not accepted: send a Content-Length", HTTPStatus.LENGTH_REQUIRED)
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        if not length.isdigit():
            self.close_connection = True
            raise RequestRejected(f"a bad Content-Length: {length!r}")
        if int(length) > _MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestRejected(f"request body over {_MAX_BODY_BYTES} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        return self.rfile.read(int(length))

    def _json_body(self):
        raw = self._body
        if raw is None:
            raise RequestRejected("a JSON body with a Content-Length header is required")
        try:
            return json.loads(raw)
        except ValueError as e:  # bad UTF-8 too
            raise RequestRejected(f"invalid JSON body: {e}") from e

    def _reload(self):
        body = self._json_body()
        if not isinstance(body, dict) or set(body) != _RELOAD_FIELDS or not all(isinstance(v, str) and v for v in body.values()):
            raise RequestRejected(f"a reload takes exactly {', '.join(sorted(_RELOAD_FIELDS))}, both non-empty strings")
        directory = Path(body["model"])
        server = self.server

        def swap() -> None:  # on the scheduler thread, the batch empty: no request sees two sets of weights
            if checkpoints.is_adapter(directory):
                server.adapters.apply(directory)
            else:
                load_weights(server.sampler.model, directory)
                server.adapters.forget()
            server.model_name, server.model_dir = body["served_model_name"], str(directory)

        started = time.monotonic()
        try:
            server.scheduler.between_steps(swap).result()
        except (OSError, ValueError) as e:
            raise RequestRejected(f"cannot reload {directory}: {e}") from e
        except EngineStopped as e:
            raise RequestRejected(str(e), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError") from e
        seconds = time.monotonic() - started
        log.info("reloaded %s in place in %.2fs as %r (%s %s)", directory, seconds, body["served_model_name"],
                 "LoRA adapter, merged into the base" if checkpoints.is_adapter(directory) else "model.safetensors", _weights_sum(directory))
        return HTTPStatus.OK, {"model": body["served_model_name"], "root": str(directory), "seconds": round(seconds, 4)}, ""

    def _pause(self):
        """vLLM's ``POST /pause``: every request not answered yet is answered now with what it
        sampled (finish reason ``abort``), or with ``wait_for_inflight_requests=true`` the
        running ones finish; then requests wait until ``POST /resume``. ``clear_cache`` is
        accepted (the engine keeps no cache between requests)."""
        query = urllib.parse.parse_qs(self.path.partition("?")[2])
        wait = query.get("wait_for_inflight_requests", ["false"])[-1].lower()
        if wait not in ("true", "false", "1", "0"):
            raise RequestRejected(f"wait_for_inflight_requests must be true or false, got {wait!r}")
        try:
            self.server.scheduler.pause(wait_for_inflight_requests=wait in ("true", "1")).result()
        except EngineStopped as e:
            raise RequestRejected(str(e), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError") from e
        return HTTPStatus.OK, {"status": "paused"}, ""

    def _resume(self):
        self.server.scheduler.resume()
        return HTTPStatus.OK, {"status": "resumed"}, ""

    def _is_paused(self):
        return HTTPStatus.OK, {"is_paused": self.server.scheduler.paused}, ""

    def _completions(self):
        body = self._json_body()
        request = parse_completion_request(body, self.server.model_name)
        job = _CompletionJob(self.server, body, request)
        try:
            generation, strings = self.server.scheduler.submit(job).result()
        except PromptRejected as e:
            raise RequestRejected(str(e)) from e
        except EngineStopped as e:
            raise RequestRejected(str(e), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError") from e
        response = completion_response(request, generation, strings, job.model_name)
        p = request.params
        scoring = "" if p.prompt_logprobs is None else f" prompt_logprobs={p.prompt_logprobs}"
        detail = (
            f"prompts={len(request.prompts)} n={p.n} max_tokens={p.max_tokens}{scoring} "
            f"completion_tokens={response['usage']['completion_tokens']} batch_requests={generation.peak_batch_requests}"
        )
        return HTTPStatus.OK, response, detail

    def log_request(self, code="-", size="-") -> None:
        pass  # _serve logs one line per request, with more to say

    def log_message(self, format: str, *args) -> None:
        # Only errors the base class answers itself reach here (a malformed request line).
        log.warning("%s %s", self.address_string(), format % args)


class _Stopped(Exception):
    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} received")


def _install_signal_handlers() -> None:
    received: list[str] = []

    def on_signal(signum, frame) -> None:
        if received:
            return  # already stopping
        received.append(signal.Signals(signum).name)
        raise _Stopped(received[0])

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _bind(args: argparse.Namespace, scheduler, name: str) -> "EngineHTTPServer":
    """The server on ``--port``, or with ``--port-tries``, the first of the ports from it that
    is free when the model is loaded."""
    port, last = args.port, (args.port + max(1, args.port_tries) - 1 if args.port else 0)
    while True:
        try:
            return EngineHTTPServer((args.host, port), scheduler, name, str(args.model))
        except OSError as e:
            if e.errno != errno.EADDRINUSE or port >= last:
                raise
            log.info("port %d is taken; trying %d", port, port + 1)
            port += 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.engine.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (safetensors)")
    parser.add_argument("--port", required=True, type=int, help="port to listen on; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port-file", type=Path, help="once listening, write the port there (useful with --port 0)")
    parser.add_argument("--port-tries", type=int, default=1,
                        help="with a --port, the first free one of it and the next ports, this many in all: a port another "
                             "process bound while this one loaded the model is skipped (default: %(default)s)")
    parser.add_argument("--base-model", type=Path,
                        help="with LoRA: the base model that --model and every reload, when an adapter directory, apply to")
    parser.add_argument("--served-model-name", help="model name in the API (default: the --model argument)")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help="most sequences (prompts x n) decoding at once, over all requests; a larger request "
                             "runs alone (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="where the model runs and every tensor the sampler makes: cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="the model's dtype; auto: the checkpoint's own, as loaded (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.max_num_seqs < 1:
        parser.error(f"--max-num-seqs must be at least 1, got {args.max_num_seqs}")
    if not _DEVICE.fullmatch(args.device):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if checkpoints.is_adapter(args.model) and args.base_model is None:
        parser.error(f"--model {args.model} is a LoRA adapter: give the model it applies to with --base-model")
    for flag, model in (("--model", args.model if not checkpoints.is_adapter(args.model) else None), ("--base-model", args.base_model)):
        if model is not None and not (model / "config.json").is_file():
            # Otherwise transformers reads the path as a Hub repo id and says something confusing.
            parser.error(f"{flag} {model}: no config.json there; expected a Hugging Face model directory")
    return args


def _publish_port(path: Path, port: int) -> None:
    """Write the bound port atomically, so a reader sees no file or the whole number."""
    fsio.atomic_write_bytes(path, f"{port}\n".encode(), durable=False)  # rewritten at every start


def place(model, device: str, dtype: str):
    """``model`` moved to ``device`` in ``dtype`` (one of DTYPES; auto: the dtype it was
    loaded in, its checkpoint's). Raises DeviceUnavailable when ``device`` is a GPU this
    torch cannot use."""
    import torch

    target = torch.device(device)
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU-only build'}) sees no "
                f"GPU; run with --device cpu, or install a CUDA build of torch on a machine with one")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"--device {device}: this machine has {torch.cuda.device_count()} visible GPU(s), "
                                    f"numbered from 0 (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return model.to(device=target, dtype=None if dtype == "auto" else getattr(torch, dtype))


def load_weights(model, directory: Path) -> None:
    """Copy ``directory``'s safetensors into ``model``'s parameters (same architecture).
    Raises ValueError naming what does not fit; a tensor left out of the file is accepted
    only when it is tied to one the file has (``lm_head`` and the embeddings)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [directory / "model.safetensors"]
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    own = model.state_dict()
    unexpected = sorted(set(tensors) - set(own))
    if unexpected:
        raise ValueError(f"its weights have tensors the served model lacks: {', '.join(unexpected[:5])}")
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the served model {tuple(own[name].shape)}")
    loaded = {own[name].data_ptr() for name in tensors}
    missing = sorted(n for n in set(own) - set(tensors) if own[n].data_ptr() not in loaded)
    if missing:
        raise ValueError(f"its weights lack {', '.join(missing[:5])}")
    model.load_state_dict(tensors, strict=False)


def _weights_sum(model_dir: Path) -> str:
    """The checksum of the weights served (``xxh3_128 <hex>``), so operators (and tests) can
    tell that every node's engine serves the same checkpoint: the one the checkpoint's
    manifest records (the rank verified it before asking), else summed here (the base model
    has no manifest)."""
    name = checkpoints.ADAPTER_WEIGHTS if checkpoints.is_adapter(model_dir) else "model.safetensors"
    weights = model_dir / name
    if not weights.is_file():
        return "sharded"
    manifest = fsio.read_record(model_dir / checkpoints.MANIFEST)
    recorded = (manifest or {}).get("files", {}).get(name, {}).get(sums.ALGORITHM)
    return f"{sums.ALGORITHM} {recorded or sums.file_sum(weights)}"


STATS_AT_EXIT = "stats at exit:"
"""Opens the log's last line of a server that stopped: its scheduler's counters as JSON (``GET /stats``)."""


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _install_signal_handlers()  # before the slow imports, so that a stop during loading is clean too
    server: EngineHTTPServer | None = None
    scheduler: Scheduler | None = None
    serving = False
    try:
        started = time.monotonic()
        adapter = args.model if checkpoints.is_adapter(args.model) else None
        model, tokenizer = loading.load(args.base_model if adapter else args.model)
        sampler = Sampler(place(model, args.device, args.dtype), tokenizer)
        # The model, torch and transformers leave some 400k objects for the cyclic collector to
        # walk in every full collection (0.2 s each, in the middle of a step); frozen, it skips them.
        gc.collect()
        gc.freeze()
        log.info(
            "loaded %s in %.1fs on %s in %s (context length %d; %s %s)",
            args.model, time.monotonic() - started, sampler.device, str(model.dtype).removeprefix("torch."), sampler.max_model_len,
            checkpoints.ADAPTER_WEIGHTS if adapter else "model.safetensors", _weights_sum(args.model),
        )
        name = args.served_model_name or str(args.model)
        scheduler = Scheduler(sampler, max_num_seqs=args.max_num_seqs)
        server = _bind(args, scheduler, name)
        if adapter is not None:
            log.info("merged the LoRA adapter %s into %s (%d weights)", adapter, args.base_model, server.adapters.apply(adapter))
        scheduler.start()
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        serving = True
        host, port = server.server_address[:2]
        log.info("listening on http://%s:%d serving model %r (up to %d sequences at once)", host, port, name,
                 args.max_num_seqs)
        if args.port_file is not None:
            _publish_port(args.port_file, port)
        threading.Event().wait()
    except _Stopped as e:
        log.info("%s: shutting down", e)
    except DeviceUnavailable as e:  # a launch mistake, not a crash: no traceback
        log.error("%s", e)
        child_error.write(e, program="engine", exit_code=EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    except Exception as e:
        log.exception("engine failed: %s: %s", type(e).__name__, e)
        child_error.write(e, program="engine", exit_code=1)
        return 1
    finally:
        if scheduler is not None:
            scheduler.stop(_SCHEDULER_STOP_S)  # requests in flight are answered 503
            log.info("%s %s", STATS_AT_EXIT, json.dumps(dataclasses.asdict(scheduler.stats())))
        if serving:
            server.shutdown()  # waits for serve_forever, so only once it runs
        if server is not None:
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
