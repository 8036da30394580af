"""The master takes the run's lease, or is refused naming the live one (the rule:
``protocol/lease.py``, ``Takeover``), and releases it as it ends."""

from __future__ import annotations

import dataclasses
import logging

from orchestrator.coordination import executor
from orchestrator.errors import BadInput, DeadlineExceeded
from orchestrator.node import identity
from orchestrator.protocol import fsio, records
from orchestrator.protocol.actions import Wait
from orchestrator.protocol.clock import REAL_CLOCK, Clock
from orchestrator.protocol.layout import RunLayout
from orchestrator.protocol.lease import HolderView, Lease, Refuse, Takeover, Watch, new_attempt_id, read_lease
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline

log = logging.getLogger(__name__)


def acquire(layout: RunLayout, timeout_s: float, poll_s: float, cancel: CancelToken, clock: Clock = REAL_CLOCK) -> Lease:
    """Become the run's master, or raise :class:`BadInput` naming the live one."""
    current = read_lease(layout, settle_s=10.0, clock=clock)
    takeover = Takeover(current, timeout_s)
    watching = False

    def decide():
        nonlocal watching
        holder = None
        if takeover.needs_holder:
            holder = HolderView(identity.same_host_process_alive(records.to_dict(current)),
                                fsio.read_record(layout.attempt(current.attempt).heartbeat(0)))
        action = takeover.decide(holder, clock.monotonic())
        if isinstance(action, Watch):
            if not watching:
                watching = True
                log.warning("run is leased to a master on host %s (pid %d); watching its heartbeat for up to %.0f s "
                            "to tell whether it is alive", current.host, current.pid, timeout_s)
            return Wait()
        return action

    # The decision ends the wait: a heartbeat that stands still for timeout_s means a dead holder.
    never = Deadline.never("the lease holder's heartbeat")
    action = executor.run(executor.Operation(decide, lambda _: DeadlineExceeded(f"timed out waiting for {never.what}")), never,
                          cancel=cancel, backoff=Backoff(poll_s, poll_s))
    if isinstance(action, Refuse):
        raise BadInput(
            f"another master is live on this run: host {current.host}, pid {current.pid} "
            f"(attempt {current.attempt}). Stop it first (orchestrator stop --log-path {layout.root}), "
            f"or start this node with --worker R"
        )
    generation = action.generation
    if action.holder_dead:
        log.warning("the master of attempt %s (host %s, pid %d) is dead; taking the run over as generation %d",
                    current.attempt, current.host, current.pid, generation)
    if not fsio.create_record_exclusive(layout.claim(generation), identity.me()):
        raise BadInput(f"another master claimed generation {generation} of this run at the same moment; start only one --master")
    me = identity.me()
    lease = Lease(generation, new_attempt_id(generation), me["host"], me["pid"], me["pid_start"])
    fsio.write_record(layout.lease, records.to_dict(lease))
    return lease


def release(layout: RunLayout, lease: Lease) -> None:
    """Mark the lease free so the next master need not wait for this one to look dead."""
    current = read_lease(layout)
    if current is not None and current.generation == lease.generation:
        fsio.write_record(layout.lease, records.to_dict(dataclasses.replace(lease, released=True)))
