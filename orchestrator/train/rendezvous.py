"""Where the trainer processes meet: the rendezvous the orchestrator's launch puts in the
environment, and ``join``, which forms the torch.distributed group there over TCP (never
``file://``: see docs/shared-filesystems.md)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from orchestrator.train.errors import BadTrainInput, RendezvousFailed

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
LISTEN_FD_ENV = "MASTER_LISTEN_FD"
"""Rank 0's: a socket already listening on ``MASTER_PORT``, which the launch held from the
moment it chose the port; the group's store serves on it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """This process's place in the group, read from the environment (``from_env``) and checked
    before anything waits on it, so a bad launch fails at once with exit status 2."""

    addr: str
    port: int
    world_size: int
    rank: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    local_rank: int
    listen_fd: int | None = None
    """Rank 0: the socket to serve the group's store on (:data:`LISTEN_FD_ENV`); None: bind ``port``."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"TRAIN_BACKEND must be gloo or nccl, got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"MASTER_PORT={self.port} is not a port")
        if not self.timeout_s > 0:
            raise ValueError(f"TRAIN_TIMEOUT_S must be > 0, got {self.timeout_s}")

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"tcp://{host}:{self.port}"

    @classmethod
    def from_env(cls, env) -> "Rendezvous":
        """Raises BadTrainInput naming the variable at fault."""
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if not env.get(v)]
        if missing:
            raise BadTrainInput(f"environment lacks {', '.join(missing)} (set by the orchestrator's launch)")
        backend = env.get("TRAIN_BACKEND") or _default_backend()
        try:
            return cls(
                addr=env["MASTER_ADDR"],
                port=int(env["MASTER_PORT"]),
                world_size=int(env["WORLD_SIZE"]),
                rank=int(env["RANK"]),
                backend=backend,
                timeout_s=float(env.get("TRAIN_TIMEOUT_S") or DEFAULT_TIMEOUT_S),
                local_rank=int(env.get("LOCAL_RANK") or 0),
                listen_fd=int(env[LISTEN_FD_ENV]) if env.get(LISTEN_FD_ENV) else None,
            )
        except ValueError as e:
            raise BadTrainInput(f"bad rendezvous environment: {e}") from None


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def join(rdv: Rendezvous):
    """Form the process group; returns this rank's device. Raises RendezvousFailed."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if rdv.backend == "nccl":
        device = torch.device("cuda", rdv.local_rank)
        torch.cuda.set_device(device)
    started = time.monotonic()
    log.info("joining rendezvous %s as rank %d of %d (%s, timeout %.0fs)", rdv.url, rdv.rank, rdv.world_size, rdv.backend, rdv.timeout_s)
    timeout = timedelta(seconds=rdv.timeout_s)
    try:
        # The store as init_method tcp:// makes it, but rank 0's on the socket the launch held for it.
        held = {"master_listen_fd": rdv.listen_fd} if rdv.listen_fd is not None and rdv.rank == 0 else {}
        store = dist.TCPStore(rdv.addr, rdv.port, rdv.world_size, rdv.rank == 0, timeout=timeout, **held)
        dist.init_process_group(rdv.backend, store=store, world_size=rdv.world_size, rank=rdv.rank, timeout=timeout,
                                device_id=device if rdv.backend == "nccl" else None)
    except Exception as e:  # torch raises DistStoreError, DistNetworkError, RuntimeError, ...
        raise RendezvousFailed(
            f"rendezvous at {rdv.url} (world size {rdv.world_size}) failed after {time.monotonic() - started:.1f}s: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. Check that every trainer rank was launched, that rank 0's host "
            f"resolves and its port is reachable from this node."
        ) from None
    log.info("process group formed in %.1fs", time.monotonic() - started)
    return device
