"""This node's train workers: processes of ``orchestrator.train.worker``, one per train
worker the placement puts here, all of one torch.distributed group across the nodes.

With ``train.keep_alive`` (the default) they are started at the attempt's first training,
with ``--serve``, and stay up: each iteration is one request line on their stdin and one
``done`` file back (train/worker.py). Their stdin is a pipe from this rank, so a rank that
ends, however it ends, ends its trainers too. While they idle between trainings they are
watched: one that exits fails the rank at once, naming it. Without keep-alive every
iteration starts the processes, which exit after their update.

A trainer that fails because it lost a peer (a collective's connection closed) is most
often the echo of another node's failure: the rank then waits, up to one node timeout, for
the monitor to name that node (exit 3, as for any peer's failure) before it reports its own
trainer.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import EXIT_BAD_INPUT, ChildFailed
from orchestrator.node import gpus
from orchestrator.node.placement import TrainWorker
from orchestrator.phase_table import Phase
from orchestrator.node.procs import Children
from orchestrator.protocol import child_error, fsio
from orchestrator.protocol.waiting import Backoff, Deadline, poll
from orchestrator.runtime.context import PhaseContext
from orchestrator.workloads.rl import trainer_address as rendezvous

log = logging.getLogger(__name__)

# What a trainer's error says when a collective lost its peer (gloo, NCCL, the final barrier).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "a peer died", "NCCL communicator was aborted",
              "Socket Timeout", "Connection refused")


class TrainerFailed(ChildFailed):
    pass


@dataclass(slots=True)
class _Process:
    worker: TrainWorker
    proc: subprocess.Popen
    log_path: Path


class NodeTrainers:
    def __init__(self, children: Children, *, keep_alive: bool, train_timeout_s: float):
        self.children = children
        self.keep_alive = keep_alive
        self.train_timeout_s = train_timeout_s
        self.running: list[_Process] = []
        self.group: tuple[tuple[int, int], ...] = ()
        """(worker, node) of the training group the running trainers belong to."""

    def update(self, ctx: PhaseContext, configs: dict[int, dict]) -> dict[int, dict]:
        """One iteration's update by this node's workers (``configs``: each one's train
        config). Returns each worker's ``done`` record (its stats, and seconds per part)."""
        attempt = ctx.run.attempt
        placement = ctx.run.placement
        workers = placement.train_workers_on(ctx.rank)
        for w in workers:
            path = attempt.trainer_config(w.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Rewritten at every start of the step: atomic for the trainer, no fsync needed.
            fsio.atomic_write_bytes(path, json.dumps(configs[w.rank], indent=2).encode(), durable=False)
            child_error.clear(attempt.trainer_error(w.rank))
            attempt.trainer_done(w.rank).unlink(missing_ok=True)
        group = tuple((w.rank, w.node) for w in placement.train_workers)
        if self.running and group != self.group:
            log.info("the training group changed (coordination.elastic): restarting this node's trainers")
            self.stop()
        self.group = group
        if not self.keep_alive:
            self.running = self._start(ctx, workers, serve=False)
        elif not self.running:
            self.running = self._start(ctx, workers, serve=True)
        else:
            log.info("training iteration %d: trainer processes %s serve on", ctx.iteration, ",".join(str(t.proc.pid) for t in self.running))
        if self.keep_alive:
            for t in self.running:
                self.children.unwatch(t.proc)  # while it trains, the wait below judges how it ends
                request = {"config": str(attempt.trainer_config(t.worker.rank)), "done": str(attempt.trainer_done(t.worker.rank))}
                try:
                    t.proc.stdin.write((json.dumps(request) + "\n").encode())
                    t.proc.stdin.flush()
                except OSError:
                    pass  # it has exited: the wait below names it
        try:
            done = self._wait(ctx)
        except BaseException:
            self.stop()  # the others of a failed step: they would wait out the collective timeout
            raise
        if self.keep_alive:
            for t in self.running:
                self._watch(ctx, t)
        else:
            self.stop()
        return done

    def _watch(self, ctx: PhaseContext, t: _Process) -> None:
        """Between trainings, a trainer that exits fails the rank at once, naming it."""
        self.children.watch(t.proc, lambda code: ctx.cancel.cancel(self._failed(ctx, t, code)))

    def _start(self, ctx: PhaseContext, workers: list[TrainWorker], *, serve: bool) -> list[_Process]:
        attempt = ctx.run.attempt
        placement = ctx.run.placement
        rdv = rendezvous.publish_or_read(ctx)
        log.info("training iteration %d: workers %s of %d on this node, rendezvous %s:%d%s", ctx.iteration,
                 ",".join(str(w.rank) for w in workers), len(placement.train_workers), rdv["addr"], rdv["port"],
                 ", kept alive for the attempt (train.keep_alive)" if serve else "")
        sockets = rendezvous.socket_env(rdv["addr"])
        if sockets:
            log.info("trainers use interface %s to reach %s (set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME to choose)",
                     next(iter(sockets.values())), rdv["addr"])
        started = []
        for w in workers:
            env = {
                **os.environ,
                "MASTER_ADDR": rdv["addr"],
                "MASTER_PORT": str(rdv["port"]),
                "WORLD_SIZE": str(len(placement.train_workers)),
                "RANK": str(w.rank),
                "LOCAL_RANK": "0",
                "TRAIN_TIMEOUT_S": str(self.train_timeout_s),
                child_error.ENV: str(attempt.trainer_error(w.rank)),
                **sockets,
            }
            if w.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus.child_visible_devices([w.gpu])
            mode = ["--serve"] if serve else ["--train-config", str(attempt.trainer_config(w.rank)), "--done", str(attempt.trainer_done(w.rank))]
            log_path = attempt.trainer_log(w.rank)
            with open(log_path, "ab") as out:
                proc = self.children.start([sys.executable, "-m", "orchestrator.train.worker", *mode], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.PIPE if serve else subprocess.DEVNULL)
            started.append(_Process(w, proc, log_path))
        return started

    def _wait(self, ctx: PhaseContext) -> dict[int, dict]:
        attempt = ctx.run.attempt
        procs = self.running

        def ended():
            """The failed workers as soon as one fails; else their done records once all are done."""
            failed = [t for t in procs if t.proc.poll() is not None and (self.keep_alive or t.proc.returncode != 0)]
            if failed:
                return failed
            if not self.keep_alive and any(t.proc.returncode is None for t in procs):
                return None
            records = {t.worker.rank: fsio.read_record(attempt.trainer_done(t.worker.rank)) for t in procs}
            if all(r is not None and r.get("iteration") == ctx.iteration for r in records.values()):
                return records
            if not self.keep_alive:  # exited 0 without its answer: an older trainer, timing unknown
                return {w: r for w, r in records.items() if r is not None and r.get("iteration") == ctx.iteration}
            return None

        # deadlines.train bounds this wait: the monitor cancels the rank when it passes.
        result = poll(ended, deadline=Deadline.never("the train workers"), cancel=ctx.cancel, backoff=Backoff(0.05, 0.2))
        if isinstance(result, dict):
            return result
        t = result[0]
        error = self._failed(ctx, t, t.proc.returncode)
        if t.proc.returncode != EXIT_BAD_INPUT and len(ctx.run.placement.train_workers) > len(procs) \
                and _lost_a_peer(error):
            wait = ctx.run.verdict_s
            log.warning("%s; waiting up to %.0f s (the monitors' verdict on a dead node: coordination.node_timeout_s, "
                        "a heartbeat and a watch interval, and the elastic grace) for the node that failed first to be named",
                        error, wait)
            ctx.cancel.sleep(wait)  # raises the peer's failure (or, elastic, the retrain) when the monitor learns it
        raise error

    def _failed(self, ctx: PhaseContext, t: _Process, code: int) -> TrainerFailed:
        what = f"train worker {t.worker.rank} of rank {ctx.rank} (pid {t.proc.pid}) exited with code {code}"
        if self.keep_alive and ctx.run.position()[1] is not Phase.TRAIN:
            what += " between trainings"
        return TrainerFailed(*child_error.explain(what, ctx.run.attempt.trainer_error(t.worker.rank), t.log_path))

    def stop(self) -> None:
        for t in self.running:
            if t.proc.stdin is not None:
                try:
                    t.proc.stdin.close()
                except OSError:
                    pass
            self.children.stop(t.proc)
        self.running = []


def _lost_a_peer(error: TrainerFailed) -> bool:
    text = str(error) + json.dumps(error.child or {})
    return any(s in text for s in _PEER_LOST)
