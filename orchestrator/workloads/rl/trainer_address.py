"""The training rendezvous address, published by the master on the shared filesystem.

The node that hosts train worker 0 publishes it (the master, unless the placement puts
worker 0 elsewhere). Not a ``file://`` store (it failed 4 of 14 runs across sshfs mounts, docs/shared-filesystems.md): the
master picks an address and a free port, writes them into the attempt's rendezvous file
(per attempt, so a crashed attempt's address is never used), and every rank's trainer
connects over TCP.
"""

from __future__ import annotations

import os
import socket

from orchestrator.node import identity
from orchestrator.node.ports import free_port
from orchestrator.protocol import fsio
from orchestrator.protocol.waiting import Deadline, poll
from orchestrator.runtime.context import PhaseContext

ADDR_ENV = "MASTER_ADDR"


def master_address() -> str:
    """``MASTER_ADDR`` if set, else this host's resolved address (loopback only serves
    ranks on this same host, as with `orchestrator local`)."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    try:
        return socket.gethostbyname(identity.host())
    except OSError:
        return "127.0.0.1"


def publish_or_read(ctx: PhaseContext) -> dict:
    """The node of train worker 0 (the master on CPU) chooses and publishes the address of
    this iteration's training (and round: a step trained again without a lost rank is a new
    group, coordination.elastic); the others read it."""
    path = ctx.run.attempt.rendezvous
    round_ = ctx.run.train_round
    if ctx.rank == ctx.run.placement.checkpoint_node:
        record = {"iteration": ctx.iteration, "round": round_, "addr": master_address(), "port": free_port(ctx.config.rl.train_port)}
        fsio.write_record(path, record)
        return record

    def probe():
        fsio.refresh_dir(path.parent)
        r = fsio.read_record(path)
        return r if r is not None and r["iteration"] == ctx.iteration and r.get("round", 0) == round_ else None

    return poll(probe, deadline=Deadline.after(ctx.config.coordination.node_timeout_s, str(path)),
                cancel=ctx.cancel, backoff=ctx.run.backoff)
