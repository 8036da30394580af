"""One node's inference engine process: start on a checkpoint, wait until healthy (with a
deadline, cancellable), stop its process group, restart on a new checkpoint."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path

from orchestrator.engine.client import EngineClient
from orchestrator.errors import DeadlineExceeded
from orchestrator.procs import Children
from orchestrator.waiting import Backoff, CancelToken, Deadline, poll

log = logging.getLogger(__name__)


class EngineProcess:
    def __init__(self, children: Children, *, first_port: int, log_dir: Path, start_timeout_s: float):
        self.children = children
        self.first_port = first_port  # 0: any free port, reported by the engine
        self.port: int | None = None
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.checkpoint: Path | None = None
        self.client: EngineClient | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ensure(self, checkpoint: Path, cancel: CancelToken) -> EngineClient:
        """The engine serving ``checkpoint``: started (or restarted) if needed."""
        if self.proc is not None and self.proc.poll() is None and self.checkpoint == checkpoint:
            return self.client
        self.stop()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.log_dir / "engine.port"
        port_file.unlink(missing_ok=True)
        # A name unique to this start: the client checks it, so it can never be served by
        # another process that holds the port (another run's engine, a leftover).
        name = f"policy-{uuid.uuid4().hex[:12]}"
        log_file = self.log_dir / "engine.log"
        log.info("starting the engine on %s (log %s)", checkpoint, log_file)
        with open(log_file, "ab") as out:
            self.proc = self.children.start(
                [sys.executable, "-m", "orchestrator.engine.server", "--model", str(checkpoint), "--port", str(self.first_port),
                 "--served-model-name", name, "--port-file", str(port_file)],
                stdout=out, stderr=subprocess.STDOUT,
            )
        self.checkpoint = checkpoint
        deadline = Deadline.after(self.start_timeout_s, f"the engine to listen (port file {port_file})")
        self.port = poll(lambda: _read_port(port_file, self.proc), deadline=deadline, cancel=cancel, backoff=Backoff(0.05, 0.5),
                         on_timeout=lambda: DeadlineExceeded(f"the engine did not start listening within "
                                                             f"rl.engine_start_timeout_s={self.start_timeout_s:g} s; see {log_file}"))
        self.client = client = EngineClient(self.url, timeout_s=600, model=name)
        client.wait_healthy(max(1.0, deadline.remaining()), should_stop=lambda: cancel.reason is not None or self.proc.poll() is not None)
        cancel.check()
        if self.proc.poll() is not None or name not in client.models():
            tail = log_file.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"the engine on port {self.port} did not come up as this rank's (exit code {self.proc.poll()}); "
                f"{log_file} ends:\n{tail}"
            )
        log.info("the engine listens on port %d", self.port)
        return client

    def stop(self) -> None:
        if self.proc is not None:
            self.children.stop(self.proc, grace_s=10.0)
            self.proc = None
            self.checkpoint = None
            self.client = None


def _read_port(port_file: Path, proc: subprocess.Popen) -> int | None:
    try:
        return int(port_file.read_text())
    except (FileNotFoundError, ValueError):
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with code {proc.returncode} before listening; see {port_file.parent}/engine.log") from None
        return None
