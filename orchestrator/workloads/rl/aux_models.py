"""Models beside the policy (``models.<name>``: a teacher, a judge): their engines on this
node, and the engines of other nodes for a node that does not serve one.

The placement says which nodes serve each model (``models.<name>.nodes`` on CPU, the nodes of
``models.<name>.device_mapping`` on GPUs; by default every node that rolls out). A node that
serves it runs one engine of it (engine_process.py), started with the policy's and never
moved, and asks that engine alone. When some node that rolls out does not serve it, each
engine listens on every interface and its node publishes where, once it serves:
``engines/r<R>/<name>-engine0.address.json`` (host, port, served name). A node that does
not serve the model reads the records of the serving nodes still in the run and asks every
engine that answers to its served name (a record left by an engine that died, or by an
earlier start, answers to none), waiting for the first and briefly for the others. Its requests fail over from an engine that stops answering
to the others; when none is left it waits for the verdict on the node that died (which ends
the rollout with that node's failure, or the run goes on without it) before the rollout
fails with an error naming the model.
"""

from __future__ import annotations

import logging
import time

from orchestrator.config import RunConfig
from orchestrator.engine.client import EngineClient, EngineError
from orchestrator.errors import DeadlineExceeded
from orchestrator.node.procs import Children
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.waiting import Backoff, Deadline, poll
from orchestrator.runtime.context import PhaseContext
from orchestrator.workloads.rl.engine_process import NodeEngines
from orchestrator.workloads.rl.engine_requests import REQUEST_TIMEOUT_S, Inflight
from orchestrator.workloads.rl.trainer_address import master_address

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
"""How long a look at another node's engine (is it serving its name?) may take."""
GRACE_S = 10.0
"""Once one engine of the model answers, how long the others still starting (or on a node
that died, which only the master learns before the next barrier) are waited for; a rollout
that goes on without them asks them from its next start."""


class ModelUnserved(EngineError):
    """No engine of a model beside the policy answers this node."""


class AuxModels:
    """This node's part in serving the models beside the policy, and its way to each."""

    def __init__(self, children: Children, config: RunConfig, layout: RunLayout):
        self.children = children
        self.config = config
        self.layout = layout
        self.engines: dict[str, NodeEngines] = {}  # the models this node serves: their engines here
        self.clients: dict[str, list[EngineClient]] = {}  # and this node's client of each

    def start(self, ctx: PhaseContext) -> None:
        """Start (or keep) this node's engine of each model it serves, and publish where it
        serves the nodes that do not; one that dies is named and fails the rank, as the
        policy's do."""
        placement = ctx.run.placement
        for name in self.config.models:
            spec = placement.aux_on(name, ctx.rank)
            if spec is None:
                continue
            if name not in self.engines:
                host = "0.0.0.0" if self._shared(ctx, name) else "127.0.0.1"
                self.engines[name] = NodeEngines(self.children, [spec], self.config.rollout, self.layout, ctx.rank,
                                                 seed=self.config.seed, model=name, host=host)
            engine = self.engines[name].engines[0]
            if engine.running:
                continue  # serving, and published when it started: nothing to read or write again
            address = self.layout.engine_address(ctx.rank, spec.engine, name)
            address.unlink(missing_ok=True)  # the last start's: its engine is gone
            self.clients[name] = self.engines[name].ensure(self.config.aux_model_path(name), ctx.cancel, timing=ctx.run.timing)
            if engine.host != "127.0.0.1":
                fsio.write_record(address, {"host": master_address(), "port": engine.port, "name": engine.name})

    def inflight(self, ctx: PhaseContext, name: str, *, max_sequences: int, sampling: dict) -> Inflight:
        """The requests of a rollout to models.<name>: to this node's engine of it, or failing
        over between those of the nodes that serve it."""
        if name in self.clients:  # this node serves it
            return Inflight(self.clients[name], max_sequences=max_sequences, sampling=sampling, timeout_s=REQUEST_TIMEOUT_S)
        remote = self.remote(ctx, name)
        return Inflight(remote, max_sequences=max_sequences, sampling=sampling, timeout_s=REQUEST_TIMEOUT_S,
                        failover=lambda _error: ctx.cancel.sleep(ctx.run.verdict_s), label=f"models.{name}")

    def remote(self, ctx: PhaseContext, name: str) -> list[EngineClient]:
        """Clients of the engines of models.<name> on the nodes that serve it and are still in
        the run: waiting up to rollout.engine_start_timeout_s for the first to serve, then up to
        :data:`GRACE_S` for the others; ModelUnserved when none did."""

        def still_in() -> list[int]:  # a node that dies meanwhile is left out once the run learns it
            return [n for n in ctx.run.placement.serving(name) if n not in ctx.run.out]

        timeout = self.config.rollout.engine_start_timeout_s
        found: dict[int, EngineClient] = {}
        first: list[float] = []  # when the first engine answered

        def probe() -> list[EngineClient] | None:
            serving = still_in()
            for node in serving:
                if node not in found and (client := self._reach(node, name)) is not None:
                    found[node] = client
                    first[:] = first or [time.monotonic()]
            if set(serving) <= set(found) or (first and time.monotonic() - first[0] > GRACE_S):
                return [found[n] for n in sorted(found) if n in serving]
            return None

        try:
            clients = poll(probe, deadline=Deadline.after(timeout, f"the engines of models.{name}"), cancel=ctx.cancel,
                           backoff=Backoff(0.1, 1.0))
            if clients:
                return clients
        except DeadlineExceeded:
            serving = still_in()
            found = {n: c for n, c in found.items() if n in serving}
            if found:
                log.warning("models.%s: the engines of node(s) %s did not serve within rollout.engine_start_timeout_s=%g s; "
                            "asking those of node(s) %s", name, ",".join(str(n) for n in serving if n not in found),
                            timeout, ",".join(map(str, sorted(found))))
                return [found[n] for n in sorted(found)]
        serving = still_in()
        if not serving:
            raise ModelUnserved(f"every node that serves models.{name} ({','.join(map(str, ctx.run.placement.serving(name)))}) is out "
                                f"of the run, and rank {ctx.rank} does not serve it: name other nodes in models.{name}.nodes "
                                f"and run again")
        logs = ", ".join(str(self.layout.engine_log(n, 0, name)) for n in serving)
        raise ModelUnserved(f"rank {ctx.rank} found no engine of models.{name} serving within rollout.engine_start_timeout_s="
                            f"{timeout:g} s on the nodes that serve it ({','.join(map(str, serving))}); see {logs}")

    def _reach(self, node: int, name: str) -> EngineClient | None:
        """A client of ``node``'s engine of models.<name>, if its record names one that serves."""
        path = self.layout.engine_address(node, 0, name)
        fsio.refresh_dir(path.parent)
        record = fsio.read_record(path)
        if record is None:
            return None
        url = f"http://{record['host']}:{record['port']}"
        try:
            if record["name"] not in EngineClient(url, timeout_s=PROBE_TIMEOUT_S).models():
                return None
        except EngineError:
            return None
        return EngineClient(url, timeout_s=REQUEST_TIMEOUT_S, model=record["name"])

    def _shared(self, ctx: PhaseContext, name: str) -> bool:
        """Some node that rolls out does not serve models.<name>: its engines serve other nodes."""
        placement = ctx.run.placement
        return bool({e.node for e in placement.engines} - set(placement.serving(name)))

    def stop(self) -> None:
        for engines in self.engines.values():
            engines.stop()
