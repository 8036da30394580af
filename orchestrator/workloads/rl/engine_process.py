"""A node's inference engines: each one a process on the GPUs the placement gave it (the
embedded server, or vLLM), started on a checkpoint, waited on until healthy (deadline,
cancellable), moved to a new checkpoint in place where the engine can (the embedded server's
``/reload``, vLLM's ``reload_weights``), else restarted, and stopped with its whole process
group. An engine without GPUs has nothing to free for training: the embedded one serves on
through it, and takes the new checkpoint in place.

A model served beside the policy (``models.<name>``: a teacher, a judge) runs in the same
kind of process, named after it (``teacher engine 0``, ``engines/rNNNNN/teacher-engine0.log``),
started once on its model and never moved; on GPUs over all its node's GPUs of
``models.<name>.device_mapping`` (tensor parallel). One that serves other nodes listens on
every interface (aux_models.py).

Ports are node-local: engine k of a node gets the first free port from the planned one
(``rollout.engine_port`` + k), and if another process takes it first the engine's failed
bind is retried on the next free port. Every start gets a served-model name of its own that
the client checks, so a rank can never be served by another process's engine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from orchestrator.config import RolloutConfig
from orchestrator import checkpoints
from orchestrator.engine import vllm
from orchestrator.engine.client import EngineClient
from orchestrator.errors import ChildFailed, DeadlineExceeded
from orchestrator.node import gpus
from orchestrator.node.placement import Engine
from orchestrator.node.ports import free_port
from orchestrator.node.procs import Children
from orchestrator.protocol import child_error
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, poll, retry

log = logging.getLogger(__name__)

BIND_RETRIES = 3
PORT_TRIES = 200
"""Ports an embedded engine tries from its own, the first free one when it binds."""
_BIND_FAILED = ("Address already in use", "Errno 98")


class EngineFailed(ChildFailed):
    """An engine exited before it served, or something else answers on its port."""


class EngineProcess:
    def __init__(self, children: Children, spec: Engine, rollout: RolloutConfig, layout: RunLayout, rank: int, *, seed: int = 0,
                 base: Path | None = None, lora_rank: int = 0, model: str = "", host: str = "127.0.0.1"):
        """``model``: the name of the auxiliary model (models.<name>) it serves; "": the policy.
        ``host``: the address it listens on (0.0.0.0: it serves other nodes too; vLLM always
        listens on every interface)."""
        self.children = children
        self.host = host
        self.spec = spec
        self.base = base  # with LoRA: the base model, which each checkpoint (an adapter) applies to
        self.lora_rank = lora_rank
        self.rollout = rollout
        self.model = model
        self.label = f"{model} engine {spec.engine}" if model else f"engine {spec.engine}"
        """What messages call it: engine 0, or teacher engine 0 (models.teacher's)."""
        self.log_file = layout.engine_log(rank, spec.engine, model)
        self._port_file = layout.engine_port_file(rank, spec.engine, model)
        self._error_file = layout.engine_error(rank, spec.engine, model)
        self.seed = seed
        self.rank = rank
        self.proc: subprocess.Popen | None = None
        self.checkpoint: Path | None = None
        self.client: EngineClient | None = None
        self.port: int | None = None
        self.name = ""
        self.asleep = False
        self.started = False  # launched at least once: a later launch is a restart

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- start ----------------------------------------------------------------------------------

    def launch(self, checkpoint: Path, taken: set[int]) -> None:
        """Start the process (not waiting for it). ``taken``: ports of this node's other engines."""
        self.stop()
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        if self.rollout.engine == "vllm":  # vLLM cannot report a port it picked: choose one for it
            self.port = free_port(self.spec.port or 8000, exclude=taken)
        else:  # the embedded server reports the port it bound (any free one with 0)
            self.port = free_port(self.spec.port, exclude=taken) if self.spec.port else 0
        self.name = _served_name(self.model)
        argv, env = self._command(checkpoint)
        log.info("starting %s (%s, GPUs %s, port %s) on %s; log %s", self.label, self.rollout.engine,
                 ",".join(map(str, self.spec.gpus)) or "none", self.port or "any", checkpoint, self.log_file)
        with open(self.log_file, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start on {checkpoint} as {self.name}, port {self.port}, "
                      f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')}\n".encode())
            out.flush()
            self.proc = self.children.start(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.checkpoint = checkpoint
        self.client = None
        self.asleep = False

    def _command(self, checkpoint: Path) -> tuple[list[str], dict]:
        if self.rollout.engine == "vllm":
            # With LoRA vLLM serves the base under a name of its own and the adapter under the policy's.
            adapter = self.base is not None and checkpoints.is_adapter(checkpoint)
            argv = vllm.serve_command(
                model=str(self.base if adapter else checkpoint), served_model_name=f"base-{self.name}" if adapter else self.name,
                port=self.port, tensor_parallel_size=len(self.spec.gpus) if self.model and self.spec.gpus else self.rollout.tensor_parallel_size,
                pipeline_parallel_size=1 if self.model else self.rollout.pipeline_parallel_size, gpu_memory_utilization=self.rollout.gpu_memory_utilization,
                max_model_len=self.rollout.max_model_len, dtype=self.rollout.dtype, seed=self.seed, extra_args=self.rollout.engine_args,
                lora_rank=self.lora_rank, adapter=(self.name, str(checkpoint)) if adapter else None,
            )
            return argv, vllm.serve_env(gpus=self.spec.gpus, base=os.environ, lora=bool(self.lora_rank))
        env = dict(os.environ)
        if self.spec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus.child_visible_devices(self.spec.gpus)
        # The server takes the first free port from self.port when it has loaded the model (the port
        # file says which): another rank of this node starting its engine as well probed the same one.
        argv = [sys.executable, "-m", "orchestrator.engine.server", "--model", str(checkpoint), "--port", str(self.port),
                "--port-tries", str(PORT_TRIES), "--served-model-name", self.name, "--port-file", str(self._port_file)]
        if self.base is not None:
            argv += ["--base-model", str(self.base)]
        if self.host != "127.0.0.1":
            argv += ["--host", self.host]
        self._port_file.unlink(missing_ok=True)
        child_error.clear(self._error_file)
        env[child_error.ENV] = str(self._error_file)
        return argv, env

    def wait_ready(self, cancel: CancelToken, taken: set[int]) -> EngineClient:
        """Wait until the launched engine serves its own name; a lost port race is retried."""

        def relaunch(_: Exception) -> None:
            log.warning("%s lost port %s to another process; retrying on the next free port", self.label, self.port)
            self.launch(self.checkpoint, taken | {self.port})

        try:
            return retry(lambda: self._wait_ready(cancel), what=f"starting {self.label}", attempts=BIND_RETRIES + 1,
                         backoff=Backoff(0.0, 0.0), retry_on=lambda e: isinstance(e, _BindFailed), before_retry=relaunch)
        except _BindFailed:
            raise EngineFailed(f"{self.label} could not bind a port after {BIND_RETRIES + 1} tries; see {self.log_file}") from None

    def _wait_ready(self, cancel: CancelToken) -> EngineClient:
        timeout = self.rollout.engine_start_timeout_s
        deadline = Deadline.after(timeout, f"{self.label} to start")
        if self.rollout.engine == "embedded":  # it reports the port it bound (any, with port 0)
            self.port = poll(self._read_port, deadline=deadline, cancel=cancel, backoff=Backoff(0.05, 0.5),
                             on_timeout=lambda: DeadlineExceeded(self._timeout_message()))
        client = EngineClient(f"http://127.0.0.1:{self.port}", timeout_s=600, model=self.name)
        try:
            client.wait_healthy(max(1.0, deadline.remaining()), should_stop=lambda: cancel.reason is not None or not self.running)
        except Exception:
            cancel.check()
            self._raise_if_exited()
            raise DeadlineExceeded(self._timeout_message()) from None
        cancel.check()
        self._raise_if_exited()
        if self.name not in client.models():
            raise EngineFailed(f"port {self.port} is served by another process, not {self.label}; see {self.log_file}")
        self.client = client
        log.info("%s serves %s on port %d", self.label, self.checkpoint, self.port)
        proc = self.proc
        self.children.watch(proc, lambda code: cancel.cancel(EngineFailed(*child_error.explain(
            f"{self.label} of rank {self.rank} (pid {proc.pid}) exited with code {code} while serving",
            self._error_file, self.log_file))))
        return client

    def _read_port(self) -> int | None:
        self._raise_if_exited()
        try:
            return int(self._port_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _raise_if_exited(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_file.read_text(errors="replace")[-child_error.LOG_TAIL_CHARS:]
            if any(s in tail for s in _BIND_FAILED):
                raise _BindFailed()
            raise EngineFailed(*child_error.explain(f"{self.label} exited with code {self.proc.returncode} before "
                                                    f"serving", self._error_file, self.log_file, tail))

    def _timeout_message(self) -> str:
        return (f"{self.label} did not serve within rollout.engine_start_timeout_s="
                f"{self.rollout.engine_start_timeout_s:g} s; see {self.log_file}")

    # -- new weights, release, stop -------------------------------------------------------------

    def switch_in_place(self, checkpoint: Path) -> bool:
        """Serve ``checkpoint`` without a restart (wake first if asleep); False: restart instead."""
        if not self.running or self.client is None or self.rollout.weight_update != "auto":
            return False
        if self.rollout.engine == "embedded":
            return self._reload_embedded(checkpoint)
        if self.lora_rank:
            return self._swap_adapter(checkpoint)
        began = time.monotonic()
        try:
            if self.asleep and not vllm.wake_up(self.client.base_url, timeout_s=self.rollout.engine_start_timeout_s):
                return False
            self.asleep = False
            if not vllm.reload_weights(self.client.base_url, str(checkpoint), timeout_s=self.rollout.engine_start_timeout_s):
                return False
        except Exception as e:  # noqa: BLE001 - any failure of the fast path falls back to a restart
            log.warning("%s could not reload weights in place (%s); restarting it", self.label, e)
            return False
        self.checkpoint = checkpoint
        log.info("%s reloaded %s in place in %.1f s", self.label, checkpoint, time.monotonic() - began)
        return True

    def _swap_adapter(self, checkpoint: Path) -> bool:
        """vLLM with LoRA: serve the adapter at ``checkpoint`` under a new name and stop serving
        the previous adapter's, the base untouched (the served-name fence as for a reload)."""
        if not checkpoints.is_adapter(checkpoint):
            return False  # a whole model: start on it
        began, name = time.monotonic(), _served_name(self.model)
        try:
            if self.asleep and not vllm.wake_up(self.client.base_url, timeout_s=self.rollout.engine_start_timeout_s):
                return False
            self.asleep = False
            vllm.load_adapter(self.client.base_url, name, str(checkpoint), timeout_s=self.rollout.engine_start_timeout_s)
            self.client.use(name)
            if self.checkpoint is not None and checkpoints.is_adapter(self.checkpoint):
                vllm.unload_adapter(self.client.base_url, self.name, timeout_s=self.rollout.engine_start_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure of the fast path falls back to a restart
            log.warning("%s could not take the LoRA adapter %s in place (%s); restarting it", self.label, checkpoint, e)
            return False
        self.name, self.checkpoint = name, checkpoint
        log.info("%s serves the LoRA adapter %s as %s, loaded in place in %.2f s", self.label, checkpoint, name,
                 time.monotonic() - began)
        return True

    def _reload_embedded(self, checkpoint: Path) -> bool:
        """The embedded server loads ``checkpoint`` into its model and from then on answers to
        a new name only: a request still naming the old policy gets a 404, never the new one."""
        name = _served_name(self.model)
        try:
            seconds = self.client.reload(str(checkpoint), name)
        except Exception as e:  # noqa: BLE001 - a refused or failed reload falls back to a restart
            log.warning("%s could not reload %s in place (%s); restarting it", self.label, checkpoint, e)
            return False
        self.name, self.checkpoint = name, checkpoint
        log.info("%s reloaded %s in place in %.2f s as %s", self.label, checkpoint, seconds, name)
        return True

    def _can_sleep(self) -> bool:
        """vLLM frees GPU memory in sleep only when started with --enable-sleep-mode (without
        it, /sleep answers 200 and frees nothing). On CPU there is nothing to free: sleeping
        just keeps the engine loaded for an in-place reload."""
        if self.rollout.engine != "vllm" or self.rollout.weight_update != "auto":
            return False
        return not self.spec.gpus or "--enable-sleep-mode" in self.rollout.engine_args.split()

    def release(self) -> str:
        """Free the GPUs for training: put vLLM to sleep where that frees them, else stop.
        An embedded engine without GPUs has nothing to free and serves on. Returns what it did:
        "kept", "slept" or "stopped"."""
        if self.running and self.client is not None and self.rollout.engine == "embedded" and not self.spec.gpus \
                and self.rollout.weight_update == "auto":
            return "kept"
        if self.running and self.client is not None and self._can_sleep():
            try:
                # Level 2 discards the weights, and waking would read them again: with LoRA the
                # base stays (level 1 offloads it to host memory) and only an adapter comes in.
                if vllm.sleep(self.client.base_url, level=1 if self.lora_rank else 2, timeout_s=60.0):
                    self.asleep = True
                    log.info("%s sleeps until phase 12 brings the new weights", self.label)
                    return "slept"
            except Exception as e:  # noqa: BLE001
                log.warning("%s could not sleep (%s); stopping it", self.label, e)
        self.stop()
        return "stopped"

    def stop(self) -> None:
        if self.proc is not None:
            self.children.stop(self.proc, grace_s=10.0)
        self.proc = None
        self.checkpoint = None
        self.client = None
        self.asleep = False


class _BindFailed(Exception):
    pass


def _served_name(model: str) -> str:
    """A served-model name of its own for each start or reload of the policy's engine (or of
    ``model``'s), which the client sends."""
    return f"{model or 'policy'}-{uuid.uuid4().hex[:12]}"


class NodeEngines:
    """The engines the placement puts on this node."""

    def __init__(self, children: Children, specs: list[Engine], rollout: RolloutConfig, layout: RunLayout, rank: int, *, seed: int = 0,
                 base: Path | None = None, lora_rank: int = 0, local: Path | None = None, model: str = "", host: str = "127.0.0.1"):
        """``model``: the engines of an auxiliary model (models.<name>), not the policy's."""
        self.engines = [EngineProcess(children, s, rollout, layout, rank, seed=seed, base=base, lora_rank=lora_rank, model=model,
                                      host=host) for s in specs]
        self.base = base
        self.local = local  # the node-local copies (publish.delta): what the engines read there is not the shared filesystem's
        self.rollout = rollout

    def ensure(self, checkpoint: Path, cancel: CancelToken, timing=None) -> list[EngineClient]:
        """Every engine serving ``checkpoint``: moved in place, or (re)started, all at once.
        ``timing(part, seconds, engine=k)`` hears how long each took (``engine.reload``,
        ``engine.restart`` or ``engine.start``)."""
        timing = timing or (lambda *a, **k: None)
        began = time.monotonic()
        starting = []
        for e in self.engines:
            if e.running and e.checkpoint == checkpoint and not e.asleep:
                continue
            t = time.monotonic()
            if e.switch_in_place(checkpoint):
                timing("engine.reload", time.monotonic() - t, engine=e.spec.engine, bytes=self._bytes(checkpoint, start=False))
                continue
            how = "engine.restart" if e.started else "engine.start"
            e.launch(checkpoint, self._ports_taken(e))
            e.started = True
            starting.append((e, how))
        for e, how in starting:
            e.wait_ready(cancel, self._ports_taken(e))
            timing(how, time.monotonic() - began, engine=e.spec.engine, bytes=self._bytes(checkpoint, start=True))
        return [e.client for e in self.engines]

    def _bytes(self, checkpoint: Path, *, start: bool) -> int:
        """The weights an engine reads to serve ``checkpoint``: a reload the checkpoint's (with
        LoRA the adapter alone), a start the base's too under an adapter. Looked up only when an
        engine moves: a rollout that finds its engines current reads no directory."""
        if self.local is not None and Path(checkpoint).is_relative_to(self.local):
            return 0  # rebuilt on the node: its bytes from the shared filesystem are counted as engine.rebuild
        adapter = start and self.base is not None and checkpoints.is_adapter(checkpoint)
        return checkpoints.weight_bytes(checkpoint) + (checkpoints.weight_bytes(self.base) if adapter else 0)

    def _ports_taken(self, me: EngineProcess) -> set[int]:
        return {e.port for e in self.engines if e is not me and e.port}

    def release(self, gpu_ids: list[int], cancel: CancelToken) -> list[str]:
        """Free this node's GPUs for training, and wait (bounded) until their memory is.
        Returns what each engine did (``EngineProcess.release``)."""
        done = [e.release() for e in self.engines]
        if gpu_ids:
            wait_memory_released(gpu_ids, self.rollout, cancel)
        return done

    def stop(self) -> None:
        for e in self.engines:
            e.stop()


def wait_memory_released(gpu_ids: list[int], rollout: RolloutConfig, cancel: CancelToken) -> None:
    """Colocated training starts only once the engines' memory is back: poll nvidia-smi until
    every training GPU of this node uses less than ``rollout.memory_released_mib``."""
    limit = rollout.memory_released_mib
    seen: dict[int, int] = {}

    def released():
        used = gpus.memory_used_mib(gpu_ids)
        if used is None:
            return True  # no nvidia-smi: nothing to wait on
        seen.update(used)
        return True if all(mib < limit for mib in used.values()) else None

    poll(released, deadline=Deadline.after(rollout.memory_release_timeout_s, "GPU memory to be released"), cancel=cancel,
         backoff=Backoff(0.2, 2.0),
         on_timeout=lambda: DeadlineExceeded(
             "GPU memory was not released within rollout.memory_release_timeout_s="
             f"{rollout.memory_release_timeout_s:g} s after the engines stopped: "
             + ", ".join(f"GPU {g} uses {mib} MiB" for g, mib in sorted(seen.items()) if mib >= limit)
             + f" (limit rollout.memory_released_mib={limit}). Look for leftover engine processes with nvidia-smi"))
