"""The training rendezvous address, published by the master on the shared filesystem.

The node that hosts train worker 0 publishes it (the master, unless the placement puts
worker 0 elsewhere). Not a ``file://`` store (it failed 4 of 14 runs across sshfs mounts, docs/shared-filesystems.md): the
master picks an address and a free port, writes them into the attempt's rendezvous file
(per attempt, so a crashed attempt's address is never used), and every rank's trainer
connects over TCP. The port is held from the moment it is chosen: the master listens on it
and hands the socket to train worker 0, which serves the group's store on it
(``MASTER_LISTEN_FD``), so that another run on the node cannot take it meanwhile (two runs
that both found 29500 free and both published it: the second's trainer failed to bind).
"""

from __future__ import annotations

import os
import socket

from orchestrator.node import identity
from orchestrator.node.ports import listening_socket
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
    group, coordination.elastic); the others read it. The publisher's record also holds
    ``listener``, the socket listening on the port, for worker 0 (train/launch.py)."""
    path = ctx.run.attempt.rendezvous
    round_ = ctx.run.train_round
    if ctx.rank == ctx.run.placement.checkpoint_node:
        listener = listening_socket(ctx.config.rl.train_port)
        try:
            record = {"iteration": ctx.iteration, "round": round_, "addr": master_address(), "port": listener.getsockname()[1]}
            fsio.write_record(path, record)
        except BaseException:
            listener.close()
            raise
        return {**record, "listener": listener}

    def probe():
        fsio.refresh_dir(path.parent)
        r = fsio.read_record(path)
        return r if r is not None and r["iteration"] == ctx.iteration and r.get("round", 0) == round_ else None

    return poll(probe, deadline=Deadline.after(ctx.config.coordination.node_timeout_s, str(path)),
                cancel=ctx.cancel, backoff=ctx.run.backoff)
