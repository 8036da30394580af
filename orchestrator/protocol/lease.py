"""The master lease: at most one live master per run, and a stale one can be replaced.

``control/lease.json`` names the holder (host, pid, process start time), the generation
(a fencing token, +1 per takeover) and the attempt the holder runs. A new master reads it:

- no lease, or a lease marked released (the run ended cleanly): take generation + 1;
- a holder on this host whose process is gone: take over at once;
- otherwise watch the holder's heartbeat: a counter that moves means a live master
  (refuse, exit 2, naming its host and pid); one that stands still for ``node_timeout_s``
  means a dead one: take over.

Two masters racing for the same generation are decided by an ``O_EXCL`` claim file.
:class:`Takeover` is that decision, pure over what is read (unit-tested with a fake clock);
coordination/master_lease.py reads, asks it, and writes.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets

from orchestrator.protocol import records
from orchestrator.errors import BadInput
from orchestrator.protocol import fsio
from orchestrator.protocol.wire import TERMINAL_STATES
from orchestrator.protocol.clock import REAL_CLOCK, Clock
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.liveness import LivenessTracker
from orchestrator.protocol.waiting import Backoff, Deadline, poll

log = logging.getLogger(__name__)

# How often a lease file that does not validate (being replaced) is read again.
_SETTLE_BACKOFF = Backoff(0.05, 0.05)


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    generation: int
    attempt: str
    host: str
    pid: int
    pid_start: float | None
    released: bool = False


_NO_LEASE = object()


def read_lease(layout: RunLayout, settle_s: float = 5.0, clock: Clock = REAL_CLOCK) -> Lease | None:
    """The current lease, or None if there is none.

    A lease file that exists but does not validate is being replaced (sshfs can serve a
    cut file): read again for up to ``settle_s`` before calling it corrupt (BadInput).
    """

    def probe():
        fsio.refresh_dir(layout.control)
        body = fsio.read_record(layout.lease)
        if body is not None:
            return records.from_dict(body, Lease)
        return _NO_LEASE if fsio.read_bytes(layout.lease) is None else None

    found = poll(
        probe, deadline=Deadline.after(settle_s, str(layout.lease), clock), backoff=_SETTLE_BACKOFF,
        on_timeout=lambda: BadInput(
            f"{layout.lease} exists but has not been a valid lease for {settle_s:g} s (corrupt?). "
            f"If no master is running, move it aside and start the master again"
        ),
    )
    return None if found is _NO_LEASE else found


@dataclasses.dataclass(frozen=True, slots=True)
class HolderView:
    """What a would-be master read of the current holder in one poll."""

    alive_here: bool | None
    """The holder runs on this host: is its process alive? None: it runs on another host."""
    heartbeat: dict | None
    """The holder's heartbeat record (None: absent or unreadable)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Take:
    generation: int
    holder_dead: bool
    """True when a holder was judged dead (not merely absent or released)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Refuse:
    holder: Lease


@dataclasses.dataclass(frozen=True, slots=True)
class Watch:
    """Not known yet: read the holder's heartbeat again."""


class Takeover:
    """May a new master take the lease from ``current``? A pure decision, one observation
    at a time, on the caller's clock: free or released leases are taken at once; a holder on
    this host is alive exactly when its process is; another host's holder is alive when its
    heartbeat counter moves, dead when it stands still for ``timeout_s`` or says it ended."""

    def __init__(self, current: Lease | None, timeout_s: float):
        self.current = current
        self._tracker = LivenessTracker(timeout_s)
        self._first_counter: object = None

    @property
    def needs_holder(self) -> bool:
        return self.current is not None and not self.current.released

    def decide(self, holder: HolderView | None, now: float) -> Take | Refuse | Watch:
        current = self.current
        if current is None:
            return Take(1, holder_dead=False)
        if current.released:
            return Take(current.generation + 1, holder_dead=False)
        assert holder is not None, "a held lease needs a view of its holder"
        if holder.alive_here is not None:
            return Refuse(current) if holder.alive_here else Take(current.generation + 1, holder_dead=True)
        hb = holder.heartbeat
        if hb is not None and hb.get("state") in TERMINAL_STATES:
            return Take(current.generation + 1, holder_dead=True)
        self._tracker.observe(0, hb, now)
        if hb is not None:
            if self._first_counter is None:
                self._first_counter = hb.get("counter")
            elif hb.get("counter") != self._first_counter:
                return Refuse(current)
        if self._tracker.dead(now):
            return Take(current.generation + 1, holder_dead=True)
        return Watch()


def new_attempt_id(generation: int) -> str:
    return f"a{generation:06d}-{secrets.token_hex(3)}"
