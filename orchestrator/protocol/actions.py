"""What the protocol's rules answer besides their own decisions, alike for every rule (a
barrier, a join): keep waiting, or the deadline passed. The coordination's executor
(coordination/executor.py) carries these out the same way for each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do but read again; ``missing``: the ranks still waited for, if the rule
    counts them; ``message``: said once to the log, if any."""

    missing: tuple[int, ...] = ()
    message: str | None = None


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The deadline passed; ``missing``: the ranks that never came (the first one is named)."""

    missing: tuple[int, ...] = ()
