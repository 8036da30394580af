"""The master lease: at most one live master per run, and a stale one can be replaced.

``control/lease.json`` names the holder (host, pid, process start time), the generation
(a fencing token, +1 per takeover) and the attempt the holder runs. A new master reads it:

- no lease, or a lease marked released (the run ended cleanly): take generation + 1;
- a holder on this host whose process is gone: take over at once;
- otherwise watch the holder's heartbeat: a counter that moves means a live master
  (refuse, exit 2, naming its host and pid); one that stands still for ``node_timeout_s``
  means a dead one: take over.

Two masters racing for the same generation are decided by an ``O_EXCL`` claim file.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from orchestrator.errors import BadInput
from orchestrator.node import identity
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.liveness import TERMINAL_STATES, LivenessTracker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    generation: int
    attempt: str
    host: str
    pid: int
    pid_start: float | None
    released: bool = False

    def to_json(self) -> dict:
        return {
            "generation": self.generation,
            "attempt": self.attempt,
            "host": self.host,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "released": self.released,
        }

    @classmethod
    def from_json(cls, d: dict) -> "Lease":
        return cls(d["generation"], d["attempt"], d["host"], d["pid"], d.get("pid_start"), d.get("released", False))


def read_lease(layout: RunLayout, settle_s: float = 5.0) -> Lease | None:
    """The current lease, or None if there is none.

    A lease file that exists but does not validate is being replaced (sshfs can serve a
    cut file): read again for up to ``settle_s`` before calling it corrupt (BadInput).
    """
    end = time.monotonic() + settle_s
    while True:
        fsio.refresh_dir(layout.control)
        body = fsio.read_record(layout.lease)
        if body is not None:
            return Lease.from_json(body)
        if fsio.read_bytes(layout.lease) is None:
            return None
        if time.monotonic() > end:
            raise BadInput(
                f"{layout.lease} exists but has not been a valid lease for {settle_s:g} s (corrupt?). "
                f"If no master is running, move it aside and start the master again"
            )
        time.sleep(0.05)


def holder_alive(layout: RunLayout, lease: Lease, timeout_s: float, poll_s: float) -> bool:
    """Is the lease holder alive? May watch its heartbeat for up to ``timeout_s``."""
    if lease.released:
        return False
    local = identity.same_host_process_alive(lease.to_json())
    if local is not None:
        return local
    hb_path = layout.attempt(lease.attempt).heartbeat(0)
    tracker = LivenessTracker(timeout_s)
    log.warning(
        "run is leased to a master on host %s (pid %d); watching its heartbeat for up to %.0f s "
        "to tell whether it is alive", lease.host, lease.pid, timeout_s,
    )
    first = None
    while True:
        now = time.monotonic()
        hb = fsio.read_record(hb_path)
        if hb is not None and hb.get("state") in TERMINAL_STATES:
            return False
        tracker.observe(0, hb, now)
        if hb is not None:
            if first is None:
                first = hb.get("counter")
            elif hb.get("counter") != first:
                return True
        if tracker.dead(now):
            return False
        time.sleep(poll_s)


def new_attempt_id(generation: int) -> str:
    return f"a{generation:06d}-{secrets.token_hex(3)}"


def acquire(layout: RunLayout, timeout_s: float, poll_s: float) -> Lease:
    """Become the run's master, or raise :class:`BadInput` naming the live one."""
    current = read_lease(layout, settle_s=10.0)
    if current is not None and holder_alive(layout, current, timeout_s, poll_s):
        raise BadInput(
            f"another master is live on this run: host {current.host}, pid {current.pid} "
            f"(attempt {current.attempt}). Stop it first (orchestrator stop --log-path {layout.root}), "
            f"or start this node with --worker R"
        )
    generation = (current.generation if current else 0) + 1
    if not fsio.create_record_exclusive(layout.claim(generation), identity.me()):
        raise BadInput(f"another master claimed generation {generation} of this run at the same moment; start only one --master")
    me = identity.me()
    lease = Lease(generation, new_attempt_id(generation), me["host"], me["pid"], me["pid_start"])
    fsio.write_record(layout.lease, lease.to_json())
    return lease


def release(layout: RunLayout, lease: Lease) -> None:
    """Mark the lease free so the next master need not wait for this one to look dead."""
    current = read_lease(layout)
    if current is not None and current.generation == lease.generation:
        fsio.write_record(layout.lease, {**lease.to_json(), "released": True})
