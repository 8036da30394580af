"""orchestrator.engine.vllm without vLLM: the server's argv and environment, and the HTTP
calls of reload / sleep / wake-up against a stub server (what vLLM 0.32 answers is checked in
tests/system/test_vllm_engine.py)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.engine import vllm
from orchestrator.engine.client import EngineError, EngineHTTPError


def test_serve_command_defaults():
    argv = vllm.serve_command(model="/ckpt/iter-3", served_model_name="policy-abc", port=8100)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {
        "--model": "/ckpt/iter-3",
        "--served-model-name": "policy-abc",
        "--host": "0.0.0.0",
        "--port": "8100",
        "--tensor-parallel-size": "1",
        "--pipeline-parallel-size": "1",
        "--gpu-memory-utilization": "0.9",
        "--dtype": "auto",
        "--seed": "0",
    }
    assert "--max-model-len" not in argv


def test_serve_command_options_and_extra_args():
    argv = vllm.serve_command(
        model="/m", served_model_name="x", port=1, host="127.0.0.1", tensor_parallel_size=4,
        pipeline_parallel_size=2, gpu_memory_utilization=0.5, max_model_len=4096, dtype="bfloat16",
        seed=7, extra_args="--enforce-eager --enable-sleep-mode --chat-template '/a b/t.jinja'", python="/venv/bin/python",
    )
    assert argv[0] == "/venv/bin/python"
    assert argv[-4:] == ["--enforce-eager", "--enable-sleep-mode", "--chat-template", "/a b/t.jinja"]
    flags = dict(zip(argv[3:-4:2], argv[4:-4:2]))
    assert flags["--tensor-parallel-size"] == "4"
    assert flags["--pipeline-parallel-size"] == "2"
    assert flags["--gpu-memory-utilization"] == "0.5"
    assert flags["--max-model-len"] == "4096"
    assert flags["--dtype"] == "bfloat16"
    assert flags["--seed"] == "7"
    assert flags["--host"] == "127.0.0.1"


def test_serve_env_gpus():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    env = vllm.serve_env(gpus=(2, 3), base=base)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PATH"] == "/bin"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert base["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"  # copied, not changed


def test_serve_env_cpu_keeps_what_is_set():
    assert vllm.serve_env(gpus=(), base={})["VLLM_CPU_KVCACHE_SPACE"] == "1"
    env = vllm.serve_env(gpus=(), base={"VLLM_CPU_KVCACHE_SPACE": "8", "HF_HUB_OFFLINE": "0", "VLLM_SERVER_DEV_MODE": "0"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert env["HF_HUB_OFFLINE"] == "0"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # the reload and sleep endpoints need it
    assert "CUDA_VISIBLE_DEVICES" not in env


class _Stub(ThreadingHTTPServer):
    """Answers each "METHOD /path" from ``routes`` (status, JSON body); 404 otherwise. Records
    every request line (with its query) and body."""

    daemon_threads = True

    def __init__(self, routes: dict):
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.routes = routes
        self.calls: list[tuple[str, dict | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _StubHandler(BaseHTTPRequestHandler):
    server: _Stub

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.calls.append((f"{method} {self.path}", body))
        status, payload = self.server.routes.get(f"{method} {self.path.split('?')[0]}", (404, {"detail": "Not Found"}))
        raw = json.dumps(payload).encode() if payload is not None else b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    servers = []

    def make(routes: dict) -> _Stub:
        s = _Stub(routes)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


VLLM_ROUTES = {
    "GET /is_sleeping": (200, {"is_sleeping": False}),
    "POST /pause": (200, {"status": "paused"}),
    "POST /collective_rpc": (200, {"results": [None]}),
    "POST /reset_prefix_cache": (200, {"success": True}),
    "POST /resume": (200, {"status": "resumed"}),
    "POST /sleep": (200, {"status": "sleeping", "level": 1}),
    "POST /wake_up": (200, {"status": "awake", "tags": None}),
}


@pytest.fixture
def checkpoint(tmp_path):
    d = tmp_path / "iter-2"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


def test_reload_weights_calls(stub, checkpoint):
    s = stub(VLLM_ROUTES)
    assert vllm.reload_weights(s.url, str(checkpoint), timeout_s=5) is True
    assert s.calls == [
        ("GET /is_sleeping", None),
        ("POST /pause?mode=wait", None),
        ("POST /collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint.resolve())}}),
        ("POST /reset_prefix_cache", None),
        ("POST /resume", None),
    ]


def test_reload_weights_leaves_a_sleeping_server_paused(stub, checkpoint):
    s = stub({**VLLM_ROUTES, "GET /is_sleeping": (200, {"is_sleeping": True})})
    assert vllm.reload_weights(s.url, str(checkpoint), timeout_s=5) is True
    assert [c for c, _ in s.calls] == ["GET /is_sleeping", "POST /collective_rpc", "POST /reset_prefix_cache"]


def test_unsupported_server_gives_false(stub, checkpoint):
    s = stub({"GET /health": (200, None)})  # the embedded engine, or vLLM without VLLM_SERVER_DEV_MODE
    assert vllm.reload_weights(s.url, str(checkpoint), timeout_s=5) is False
    assert vllm.sleep(s.url, 1, timeout_s=5) is False
    assert vllm.wake_up(s.url, timeout_s=5) is False


def test_worker_without_reload_weights_gives_false_and_resumes(stub, checkpoint):
    message = "Call to collective_rpc method failed: Worker failed with error ''Worker' object has no attribute 'reload_weights''"
    s = stub({**VLLM_ROUTES, "POST /collective_rpc": (500, {"error": {"message": message, "code": 500}})})
    assert vllm.reload_weights(s.url, str(checkpoint), timeout_s=5) is False
    assert s.calls[-1][0] == "POST /resume"


def test_reload_failure_raises(stub, checkpoint):
    s = stub({**VLLM_ROUTES, "POST /collective_rpc": (500, {"error": {"message": "Worker failed: shape mismatch", "code": 500}})})
    with pytest.raises(EngineHTTPError, match="shape mismatch"):
        vllm.reload_weights(s.url, str(checkpoint), timeout_s=5)


def test_prefix_cache_not_reset_raises(stub, checkpoint):
    s = stub({**VLLM_ROUTES, "POST /reset_prefix_cache": (200, {"success": False})})
    with pytest.raises(EngineError, match="prefix cache"):
        vllm.reload_weights(s.url, str(checkpoint), timeout_s=5)


def test_reload_from_a_non_checkpoint_never_reaches_the_server(stub, tmp_path):
    s = stub(VLLM_ROUTES)
    for bad in (tmp_path / "missing", tmp_path):
        with pytest.raises(FileNotFoundError, match="not a Hugging Face checkpoint"):
            vllm.reload_weights(s.url, str(bad), timeout_s=5)
    assert s.calls == []


def test_sleep_and_wake_up_calls(stub):
    s = stub(VLLM_ROUTES)
    assert vllm.sleep(s.url, 2, timeout_s=5) is True
    assert vllm.wake_up(s.url, timeout_s=5) is True
    assert vllm.wake_up(s.url, timeout_s=5, tags=["weights"]) is True
    assert [c for c, _ in s.calls] == ["POST /sleep?level=2", "POST /wake_up", "POST /wake_up?tags=weights"]
    with pytest.raises(ValueError):
        vllm.sleep(s.url, 3, timeout_s=5)


def test_serve_command_with_lora_serves_adapters_up_to_the_rank_vllm_takes():
    argv = vllm.serve_command(model="/base", served_model_name="base-p", port=1, lora_rank=12, adapter=("p", "/run/iter-1"))
    assert argv[argv.index("--enable-lora"):] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--lora-modules", "p=/run/iter-1"]
    assert "--enable-lora" not in vllm.serve_command(model="/m", served_model_name="x", port=1)
    assert vllm.serve_env(gpus=(), base={}, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm.serve_env(gpus=(), base={})
    assert [vllm.max_lora_rank(r) for r in (1, 2, 8, 64, 500)] == [1, 8, 8, 64, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        vllm.max_lora_rank(513)
