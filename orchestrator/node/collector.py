"""The cyclic garbage collector of the orchestrator's own processes: a rank, an engine, a trainer.

Each of them imports torch and transformers, some 300,000 objects that are never garbage, and
CPython's default (a young collection every 700 allocations) walks them again and again while
they load: five full collections during the imports alone, a third of a second of a process's
start (3.7 s for an embedded engine on the development machine; one in eight of its seconds).
:func:`tune` makes the young generation 10,000 allocations, which the imports then cross without
a full collection; it is called first thing by each process's entry point (the command line's
``main``, before any command imports them; ``orchestrator.engine.server`` and
``orchestrator.train.worker`` run as programs), never on import, so a program that imports the
package keeps its own collector settings.
"""

from __future__ import annotations

import gc

YOUNG = 10_000
"""Allocations (less deallocations) between collections of the youngest generation."""


def tune() -> None:
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
