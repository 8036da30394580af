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
