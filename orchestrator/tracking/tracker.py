"""The master's experiment tracking: after each iteration completes, its figures go to every
backend of ``tracking.backends``, with the iteration as the step, off the barrier's path (one
thread, woken by :meth:`Tracker.poke`).

Each step is logged once per backend, whatever crashes: each backend reads back what it
holds when it opens (backends.py), and every complete iteration it lacks is logged, the
ones a kill cut off included. A backend that fails to open or to log is left for the rest of
the process after one warning; the run goes on. ``tracking/state.json`` says which backends
log, up to which iteration, where, and why one failed (`status` shows it), and keeps the
tracked run's ids so that a resumed run continues the same tracked run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

from orchestrator.config import RunConfig
from orchestrator.ops.event_fold import EventReader
from orchestrator.ops.timing import iteration_timing
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.tracking.backends import open_backend
from orchestrator.tracking.metrics import iteration_metrics

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0


def state_path(layout: RunLayout):
    return layout.tracking / "state.json"


def read_state(layout: RunLayout) -> dict | None:
    return fsio.read_record(state_path(layout))


def _config(config: RunConfig) -> dict:
    """The run's configuration as plain JSON values (paths and enums as text)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


class Tracker:
    def __init__(self, config: RunConfig):
        self.config = config
        self.layout = RunLayout(config.log_path)
        self.run_name = config.tracking.run_name or config.log_path.name
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._backends: dict = {}
        self._status: dict[str, dict] = {}
        self._ids: dict[str, str] = {}
        self._next = 1
        """The first iteration not logged yet in this process: the ones before are final."""

    def poke(self) -> None:
        """Log every complete iteration the backends lack, in the background (started at the first call)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tracking", daemon=True)
            self._thread.start()
        self._wake.set()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Log what is complete, then close every backend; waits at most ``timeout_s``."""
        if self._thread is None:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("tracking: still busy after %.0f s at the end of the run; leaving it (what it logged is kept, and a "
                        "rerun of the same command logs whatever is missing)", timeout_s)

    def _run(self) -> None:
        self._open()
        events = EventReader(self.layout, master_only=True)
        while True:
            self._wake.wait()
            self._wake.clear()
            closing = self._closing
            try:
                self._catch_up(events)
            except Exception as e:  # noqa: BLE001 - reading the run's own files; never fail the run for it
                log.warning("tracking: could not read the run's figures: %s: %s", type(e).__name__, e)
            if closing:
                break
        for name, backend in list(self._backends.items()):
            self._guard(name, backend.close)
        self._write_state()

    def _open(self) -> None:
        state = read_state(self.layout) or {}
        self._ids = dict(state.get("ids") or {})
        config = _config(self.config)
        for name in self.config.tracking.backends:
            try:
                backend = open_backend(name, self.layout.tracking, self.run_name, self.config.tracking.project, config, self._ids)
            except Exception as e:  # noqa: BLE001 - an optional package, a server: never fail the run for it
                self._failed(name, "open", e)
                continue
            self._backends[name] = backend
            steps = [s for s in backend.logged if s > 0]
            self._status[name] = {"ok": True, "where": backend.where, "iteration": max(steps, default=None), "error": None}
            log.info("tracking: %s logs to %s", name, backend.where)
        self._write_state()

    def _catch_up(self, events: EventReader) -> None:
        if not self._backends:
            return
        timing = iteration_timing(events.read())
        iteration, wrote = self._next, False
        while self._backends:
            times = timing.get(iteration) or {}
            metrics = iteration_metrics(self.layout, iteration, times.get("phases"), times.get("bytes"))
            if metrics is None:
                break
            for name, backend in list(self._backends.items()):
                have = backend.logged.get(iteration, set())
                todo = {k: v for k, v in metrics.items() if k not in have}
                if todo and self._guard(name, lambda b=backend, t=todo: b.log(iteration, t)):
                    backend.logged.setdefault(iteration, set()).update(todo)
                    self._status[name]["iteration"] = iteration
                    wrote = True
            iteration += 1
        self._next = iteration
        if wrote:
            self._write_state()

    def _guard(self, name: str, action) -> bool:
        """Run ``action`` of backend ``name``; a failure leaves the backend for good, with one warning."""
        try:
            action()
            return True
        except Exception as e:  # noqa: BLE001 - see _open
            self._backends.pop(name, None)
            self._failed(name, "log", e)
            return False

    def _failed(self, name: str, doing: str, e: Exception) -> None:
        error = f"{type(e).__name__}: {e}"
        hint = " (pip install 'orchestrator[tracking]')" if isinstance(e, ImportError) else ""
        log.warning("tracking: %s failed to %s: %s%s; the run goes on without it", name, doing, error, hint)
        self._status[name] = {**self._status.get(name, {}), "ok": False, "error": error[:500]}
        self._write_state()

    def _write_state(self) -> None:
        try:
            fsio.write_record(state_path(self.layout), {"run_name": self.run_name, "project": self.config.tracking.project,
                                                        "ids": self._ids, "backends": self._status})
        except OSError as e:
            log.warning("tracking: could not write %s: %s", state_path(self.layout), e)
