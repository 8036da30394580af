"""The embedded inference engine: its own process, serving the subset of vLLM's
OpenAI-compatible HTTP API that the rollout uses, so that the rollout talks to it exactly as
it talks to vLLM.

    python -m orchestrator.engine.server --model DIR --port P [--host 127.0.0.1] [--served-model-name NAME]

The model is loaded first (``orchestrator.demo.model.load``, safetensors only); then the port
is bound and one line ``listening on http://HOST:PORT`` is logged (``--port 0`` lets the OS
pick the port, and that line says which). From then on ``GET /health`` answers 200.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (non-streaming). A
request that cannot be served as asked gets a 400 rather than a silent approximation: unknown
fields, ``stream``, ``echo`` and token-id prompts included. SIGTERM or SIGINT stops the
server and the process exits 0. One log line per request goes to stderr.

``POST /reload`` with ``{"model": DIR, "served_model_name": NAME}`` moves the running server
to another checkpoint of the same architecture, in place (the counterpart of vLLM's
``reload_weights``): DIR's safetensors are copied into the loaded model between two
generations, and from then on the server answers to NAME only, so that a client still
asking for the old name gets a 404 instead of the new policy's samples. A checkpoint that
does not fit (another architecture, missing tensors) is a 400 and the old one serves on.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from orchestrator.data import checkpoints, shards
from orchestrator.engine.sampling import Generation, PromptTooLong, Sampler, SamplingParams
from orchestrator.protocol import child_error, fsio

log = logging.getLogger("orchestrator.engine.server")

_LOGPROB_FLOOR = -9999.0  # what vLLM sends instead of -inf, which JSON cannot carry
_MAX_BODY_BYTES = 64 * 1024 * 1024


class RequestRejected(Exception):
    """The request cannot be served; ``status`` and ``kind`` go into the error response."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompts: list[str]
    params: SamplingParams
    return_token_ids: bool


_RELOAD_FIELDS = frozenset({"model", "served_model_name"})

_FIELDS = frozenset(
    {"model", "prompt", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs", "return_token_ids"}
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
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    else:
        raise RequestRejected(
            "'prompt' must be a string or a non-empty list of strings (token-id prompts are not supported)"
        )
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
        )
    except ValueError as e:
        raise RequestRejected(str(e)) from e
    return_token_ids = _field(body, "return_token_ids", None, lambda v: isinstance(v, bool), "a boolean or null")
    return CompletionRequest(prompts, params, bool(return_token_ids))


def completion_response(request: CompletionRequest, generation: Generation, sampler: Sampler, model_name: str) -> dict:
    """The OpenAI ``text_completion`` object, shaped as vLLM shapes it."""
    choices = []
    completion_tokens = 0
    for j, samples in enumerate(generation.samples):
        for sample in samples:
            logprobs = None
            if request.params.logprobs is not None:
                tokens = [sampler.token_string(t) for t in sample.token_ids]
                offsets, at = [], 0
                for token in tokens:
                    offsets.append(at)
                    at += len(token)
                top = []
                for t, lp, alternatives in zip(sample.token_ids, sample.token_logprobs, sample.top_logprobs):
                    # As vLLM does: the sampled token first, then the k most likely.
                    step = {sampler.token_string(t): max(lp, _LOGPROB_FLOOR)}
                    for alt, alt_lp in alternatives:
                        step.setdefault(sampler.token_string(alt), max(alt_lp, _LOGPROB_FLOOR))
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
                    "prompt_logprobs": None,
                    "prompt_token_ids": generation.prompt_token_ids[j] if request.return_token_ids else None,
                    "token_ids": sample.token_ids if request.return_token_ids else None,
                }
            )
            completion_tokens += len(sample.token_ids)
    prompt_tokens = sum(len(ids) for ids in generation.prompt_token_ids)  # once per prompt, not per sample
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
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

    def __init__(self, address: tuple[str, int], sampler: Sampler, model_name: str, model_dir: str):
        super().__init__(address, _Handler)
        self.sampler = sampler
        self.model_name = model_name
        self.model_dir = model_dir
        self.created = int(time.time())
        self.generate_lock = threading.Lock()  # one generation at a time


class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer
    server_version = "orchestrator-engine"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        started = time.monotonic()
        routes = {
            "/health": ("GET", self._health),
            "/v1/models": ("GET", self._models),
            "/v1/completions": ("POST", self._completions),
            "/reload": ("POST", self._reload),
        }
        path = self.path.split("?", 1)[0]
        detail = ""
        try:
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

    def _json_body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestRejected("a JSON body with a Content-Length header is required")
        if int(length) > _MAX_BODY_BYTES:
            raise RequestRejected(f"request body over {_MAX_BODY_BYTES} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except ValueError as e:  # bad UTF-8 too
            raise RequestRejected(f"invalid JSON body: {e}") from e

    def _reload(self):
        body = self._json_body()
        if not isinstance(body, dict) or set(body) != _RELOAD_FIELDS or not all(isinstance(v, str) and v for v in body.values()):
            raise RequestRejected(f"a reload takes exactly {', '.join(sorted(_RELOAD_FIELDS))}, both non-empty strings")
        directory = Path(body["model"])
        started = time.monotonic()
        with self.server.generate_lock:  # between two generations: no request sees two sets of weights
            try:
                load_weights(self.server.sampler.model, directory)
            except (OSError, ValueError) as e:
                raise RequestRejected(f"cannot reload {directory}: {e}") from e
            self.server.model_name, self.server.model_dir = body["served_model_name"], str(directory)
        seconds = time.monotonic() - started
        log.info("reloaded %s in place in %.2fs as %r (model.safetensors sha256 %s)", directory, seconds, body["served_model_name"],
                 _weights_sha256(directory))
        return HTTPStatus.OK, {"model": body["served_model_name"], "root": str(directory), "seconds": round(seconds, 4)}, ""

    def _completions(self):
        body = self._json_body()
        request = parse_completion_request(body, self.server.model_name)
        # The response decodes token strings: HF fast tokenizers must not be used from two
        # threads at once, so that happens under the lock too.
        with self.server.generate_lock:
            # Checked again under the lock: a reload may have renamed the policy while this waited.
            parse_completion_request(body, self.server.model_name)
            try:
                generation = self.server.sampler.generate(request.prompts, request.params)
            except PromptTooLong as e:
                raise RequestRejected(str(e)) from e
            response = completion_response(request, generation, self.server.sampler, self.server.model_name)
        p = request.params
        detail = (
            f"prompts={len(request.prompts)} n={p.n} max_tokens={p.max_tokens} "
            f"completion_tokens={response['usage']['completion_tokens']}"
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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.engine.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (safetensors)")
    parser.add_argument("--port", required=True, type=int, help="port to listen on; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port-file", type=Path, help="once listening, write the port there (useful with --port 0)")
    parser.add_argument("--served-model-name", help="model name in the API (default: the --model argument)")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        # Otherwise transformers reads the path as a Hub repo id and says something confusing.
        parser.error(f"--model {args.model}: no config.json there; expected a Hugging Face model directory")
    return args


def _publish_port(path: Path, port: int) -> None:
    """Write the bound port atomically, so a reader sees no file or the whole number."""
    fsio.atomic_write_bytes(path, f"{port}\n".encode(), durable=False)  # rewritten at every start


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


def _weights_sha256(model_dir: Path) -> str:
    """The content hash of the weights served, so operators (and tests) can tell that every
    node's engine serves the same checkpoint: the one the checkpoint's manifest records (the
    rank verified it before asking), else hashed here (the base model has no manifest)."""
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        return "sharded"
    manifest = fsio.read_record(model_dir / checkpoints.MANIFEST)
    recorded = (manifest or {}).get("files", {}).get("model.safetensors", {}).get("sha256")
    return recorded or shards.sha256_file(weights)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _install_signal_handlers()  # before the slow imports, so that a stop during loading is clean too
    server: EngineHTTPServer | None = None
    serving = False
    try:
        from orchestrator.demo.model import load

        started = time.monotonic()
        model, tokenizer = load(args.model)
        sampler = Sampler(model, tokenizer)
        log.info(
            "loaded %s in %.1fs (context length %d; model.safetensors sha256 %s)",
            args.model, time.monotonic() - started, sampler.max_model_len, _weights_sha256(args.model),
        )
        name = args.served_model_name or str(args.model)
        server = EngineHTTPServer((args.host, args.port), sampler, name, str(args.model))
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        serving = True
        host, port = server.server_address[:2]
        log.info("listening on http://%s:%d serving model %r", host, port, name)
        if args.port_file is not None:
            _publish_port(args.port_file, port)
        threading.Event().wait()
    except _Stopped as e:
        log.info("%s: shutting down", e)
    except Exception as e:
        log.exception("engine failed: %s: %s", type(e).__name__, e)
        child_error.write(e, program="engine", exit_code=1)
        return 1
    finally:
        if serving:
            server.shutdown()  # waits for serve_forever, so only once it runs
        if server is not None:
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
