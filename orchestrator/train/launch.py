"""This node's train workers as processes: the launcher of ``orchestrator.train.worker``, one
process per train worker the placement puts on the node, all of one torch.distributed group
across the nodes (what torchrun's agent is to its workers).

The workload describes an iteration's update once, as a :class:`Step` (its workers, their
requests and files, the group, how to reach the rendezvous); this module writes the
requests, starts or reuses the processes, waits for their ``done`` records and judges how
they end.

With ``train.keep_alive`` (the default) the processes start at the attempt's first training,
with ``--serve``, and stay up: each iteration is one request line on their stdin and one
``done`` file back (train/worker.py). Their stdin is a pipe from this rank, so a rank that
ends, however it ends, ends its trainers too. While they idle between trainings they are
watched: one that exits fails the rank at once, naming it. Without keep-alive every
iteration starts the processes, which exit after their update.

A trainer that fails because it lost a peer (a collective's connection closed) is most
often the echo of another node's failure: the rank then waits, up to ``Step.peer_verdict_s``,
for the monitor to name that node (exit 3, as for any peer's failure) before it reports its
own trainer.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from orchestrator.errors import EXIT_BAD_INPUT, ChildFailed
from orchestrator.node import gpus
from orchestrator.node.procs import Children
from orchestrator.protocol import child_error, fsio
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, poll
from orchestrator.train.rendezvous import LISTEN_FD_ENV

log = logging.getLogger(__name__)

# What a trainer's error says when a collective lost its peer (gloo, NCCL, the final barrier).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "a peer died", "NCCL communicator was aborted",
              "Socket Timeout", "Connection refused")


class TrainerFailed(ChildFailed):
    pass


@dataclass(frozen=True, slots=True)
class WorkerFiles:
    """Where a train worker's request, answer, error record and log are (the attempt's)."""

    request: Path
    done: Path
    error: Path
    log: Path


@dataclass(frozen=True, slots=True)
class Worker:
    """One train worker on this node: its rank in the group, its GPU (None on CPU), this
    iteration's train request (train/request.py) and its files."""

    rank: int
    gpu: int | None
    request: dict
    files: WorkerFiles


@dataclass(frozen=True, slots=True)
class Step:
    """One iteration's update on this node, as the launcher needs it."""

    iteration: int
    node: int
    """This node's rank in the run (for messages)."""
    workers: tuple[Worker, ...]
    group: tuple[tuple[int, int], ...]
    """(worker, node) of every train worker in the group, this node's and the others'."""
    rendezvous: Callable[[], dict]
    """The group's address (``addr``, ``port``), asked only when processes start."""
    cancel: CancelToken
    timeout_s: float
    """The collectives' timeout inside the trainers (TRAIN_TIMEOUT_S)."""
    peer_verdict_s: float
    """How long a trainer that lost a peer waits for the monitor to name the node that failed first."""
    training: Callable[[], bool]
    """Whether the rank is in its train phase now (a trainer that exits outside it failed between trainings)."""


@dataclass(slots=True)
class _Process:
    worker: Worker
    proc: subprocess.Popen


class NodeTrainers:
    def __init__(self, children: Children, *, keep_alive: bool):
        self.children = children
        self.keep_alive = keep_alive
        self.running: list[_Process] = []
        self.group: tuple[tuple[int, int], ...] = ()
        """(worker, node) of the training group the running trainers belong to."""

    @property
    def gpus(self) -> set[int]:
        """The GPUs the running trainers hold."""
        return {t.worker.gpu for t in self.running if t.worker.gpu is not None}

    def update(self, step: Step) -> dict[int, dict]:
        """One iteration's update by this node's workers. Returns each worker's ``done``
        record (its stats, and seconds per part)."""
        for w in step.workers:
            w.files.request.parent.mkdir(parents=True, exist_ok=True)
            # Rewritten at every start of the step: atomic for the trainer, no fsync needed.
            fsio.atomic_write_bytes(w.files.request, json.dumps(w.request, indent=2).encode(), durable=False)
            child_error.clear(w.files.error)
            w.files.done.unlink(missing_ok=True)
        if self.running and step.group != self.group:
            log.info("the training group changed (coordination.elastic): restarting this node's trainers")
            self.stop()
        self.group = step.group
        if not self.keep_alive:
            self.running = self._start(step, serve=False)
        elif not self.running:
            self.running = self._start(step, serve=True)
        else:
            log.info("iteration %d trains on the trainer processes kept from the last training (pids %s, train.keep_alive): "
                     "each takes this iteration's request", step.iteration, ",".join(str(t.proc.pid) for t in self.running))
            mine = {w.rank: w for w in step.workers}
            for t in self.running:
                t.worker = mine[t.worker.rank]  # the same group: the same workers, this iteration's requests
        if self.keep_alive:
            for t in self.running:
                self.children.unwatch(t.proc)  # while it trains, the wait below judges how it ends
                request = {"config": str(t.worker.files.request), "done": str(t.worker.files.done)}
                try:
                    t.proc.stdin.write((json.dumps(request) + "\n").encode())
                    t.proc.stdin.flush()
                except OSError:
                    pass  # it has exited: the wait below names it
        try:
            done = self._wait(step)
        except BaseException:
            self.stop()  # the others of a failed step: they would wait out the collective timeout
            raise
        if self.keep_alive:
            for t in self.running:
                self._watch(step, t)
        else:
            self.stop()
        return done

    def _watch(self, step: Step, t: _Process) -> None:
        """Between trainings, a trainer that exits fails the rank at once, naming it."""
        self.children.watch(t.proc, lambda code: step.cancel.cancel(self._failed(step, t, code)))

    def _start(self, step: Step, *, serve: bool) -> list[_Process]:
        rdv = step.rendezvous()
        log.info("training iteration %d: workers %s of %d on this node, rendezvous %s:%d%s", step.iteration,
                 ",".join(str(w.rank) for w in step.workers), len(step.group), rdv["addr"], rdv["port"],
                 ", kept alive for the attempt (train.keep_alive)" if serve else "")
        sockets = socket_env(rdv["addr"])
        if sockets:
            log.info("trainers use interface %s to reach %s (set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to choose)",
                     next(iter(sockets.values())), rdv["addr"])
        listener = rdv.get("listener")  # this node publishes: worker 0 serves the group's store on it
        try:
            return self._start_workers(step, rdv, sockets, serve, listener)
        finally:
            if listener is not None:
                listener.close()  # worker 0 holds its own copy

    def _start_workers(self, step: Step, rdv: dict, sockets: dict, serve: bool, listener) -> list[_Process]:
        started = []
        for w in step.workers:
            env = {
                **os.environ,
                "MASTER_ADDR": rdv["addr"],
                "MASTER_PORT": str(rdv["port"]),
                "WORLD_SIZE": str(len(step.group)),
                "RANK": str(w.rank),
                "LOCAL_RANK": "0",
                "TRAIN_TIMEOUT_S": str(step.timeout_s),
                child_error.ENV: str(w.files.error),
                **sockets,
            }
            if w.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus.child_visible_devices([w.gpu])
            fds = ()
            if listener is not None and w.rank == 0:
                fds = (listener.fileno(),)
                env[LISTEN_FD_ENV] = str(listener.fileno())
            mode = ["--serve"] if serve else ["--train-config", str(w.files.request), "--done", str(w.files.done)]
            with open(w.files.log, "ab") as out:
                proc = self.children.start([sys.executable, "-m", "orchestrator.train.worker", *mode], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.PIPE if serve else subprocess.DEVNULL,
                                           pass_fds=fds)
            started.append(_Process(w, proc))
        return started

    def _wait(self, step: Step) -> dict[int, dict]:
        procs = self.running

        def ended():
            """The failed workers as soon as one fails; else their done records once all are done."""
            failed = [t for t in procs if t.proc.poll() is not None and (self.keep_alive or t.proc.returncode != 0)]
            if failed:
                return failed
            if not self.keep_alive and any(t.proc.returncode is None for t in procs):
                return None
            records = {t.worker.rank: fsio.read_record(t.worker.files.done) for t in procs}
            if all(r is not None and r.get("iteration") == step.iteration for r in records.values()):
                return records
            if not self.keep_alive:  # exited 0 without its answer: an older trainer, timing unknown
                return {w: r for w, r in records.items() if r is not None and r.get("iteration") == step.iteration}
            return None

        # deadlines.train bounds this wait: the monitor cancels the rank when it passes.
        result = poll(ended, deadline=Deadline.never("the train workers"), cancel=step.cancel, backoff=Backoff(0.05, 0.2))
        if isinstance(result, dict):
            return result
        t = result[0]
        error = self._failed(step, t, t.proc.returncode)
        if t.proc.returncode != EXIT_BAD_INPUT and len(step.group) > len(procs) and _lost_a_peer(error):
            log.warning("%s; waiting up to %.0f s (the monitors' verdict on a dead node: coordination.node_timeout_s, "
                        "a heartbeat and a watch interval, and the elastic grace) for the node that failed first to be named",
                        error, step.peer_verdict_s)
            step.cancel.sleep(step.peer_verdict_s)  # raises the peer's failure (or, elastic, the retrain) when the monitor learns it
        raise error

    def _failed(self, step: Step, t: _Process, code: int) -> TrainerFailed:
        what = f"train worker {t.worker.rank} of rank {step.node} (pid {t.proc.pid}) exited with code {code}"
        if self.keep_alive and not step.training():
            what += " between trainings"
        return TrainerFailed(*child_error.explain(what, t.worker.files.error, t.worker.files.log))

    def stop(self) -> None:
        for t in self.running:
            if t.proc.stdin is not None:
                try:
                    t.proc.stdin.close()
                except OSError:
                    pass
            self.children.stop(t.proc)
        self.running = []


def socket_ifname(addr: str) -> str | None:
    """The interface this node reaches ``addr`` through: the one holding it on its own node,
    else the one its route leaves by. Gloo and NCCL otherwise take the interface of the host
    name's address, which is often 127.0.0.1 (the classic multi-node hang: peers are told to
    connect to loopback)."""
    import psutil

    from orchestrator.node.facts import route_to

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    route = route_to([addr])
    return route["dev"] if route else None


def socket_env(addr: str, environ=os.environ) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for the trainers, unless the user set them."""
    unset = [v for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not environ.get(v)]
    ifname = socket_ifname(addr) if unset else None
    return {v: ifname for v in unset} if ifname else {}


def _lost_a_peer(error: TrainerFailed) -> bool:
    text = str(error) + json.dumps(error.child or {})
    return any(s in text for s in _PEER_LOST)
