"""The one wait loop of a rank's coordination, in the manner of torch elastic's rendezvous
executor: an operation reads the files it decides on and asks its rule (protocol/) what to
do; this loop carries out what every rule may answer alike, and hands the rest to the
operation, until it is done, the deadline passes or the rank is cancelled.

- ``Wait``: read again after the backoff's pause (sooner when a same-host wake-up comes);
  its message, if any, is logged once;
- ``TimedOut``: raise what the operation makes of it (naming the rank to blame);
- anything else: the operation's ``act``, which returns the result (the wait is over) or
  None (read again).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from orchestrator.protocol.actions import TimedOut, Wait
from orchestrator.protocol.waiting import Backoff, CancelToken, Deadline, poll

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class Operation(Generic[T]):
    """One wait of the rank, as the executor runs it."""

    decide: Callable[[], object]
    """Read the files and return the rule's action (``Wait``, ``TimedOut`` or the rule's own)."""
    timed_out: Callable[[TimedOut | None], BaseException]
    """The error of a deadline that passed (the rule's ``TimedOut``, or None when the loop's own deadline did)."""
    act: Callable[[object], T | None] = lambda action: action
    """Carry out an action of the rule's own; its result ends the wait, None reads again."""


def run(op: Operation[T], deadline: Deadline, *, cancel: CancelToken, backoff: Backoff, wake: threading.Event | None = None,
        pace: Callable[[], float] | None = None) -> T:
    """Carry out ``op`` until it has a result; raises the cancel reason, or ``op.timed_out``."""
    said: set[str] = set()

    def step() -> T | None:
        action = op.decide()
        if isinstance(action, Wait):
            if action.message and action.message not in said:
                said.add(action.message)
                log.info("%s", action.message)
            return None
        if isinstance(action, TimedOut):
            raise op.timed_out(action)
        return op.act(action)

    return poll(step, deadline=deadline, cancel=cancel, backoff=backoff, wake=wake, pace=pace, on_timeout=lambda: op.timed_out(None))
