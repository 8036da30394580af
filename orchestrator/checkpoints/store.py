"""Where a run's checkpoints live and how one comes to be there: written into a staging
directory, sealed (manifest.py), renamed into place whole; and the current pointer,
``checkpoints/current.json``, which names the policy the run has published:
``{"iteration": I, "path": "checkpoints/iter-<I>"}`` (no pointer: the base model).

A checkpoint directory appears only by rename, so it is complete or absent; a staging
directory left by a try that never got there (a crash, an elastic round cut short) is removed
once the checkpoint is in place.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from orchestrator.checkpoints import manifest
from orchestrator.protocol import fsio
from orchestrator.protocol.layout import RunLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The policy as a checkpoint: the base model (iteration 0) or one the run published."""

    path: Path
    iteration: int

    @property
    def is_base(self) -> bool:
        return self.iteration == 0


def current(layout: RunLayout, base: Path) -> Checkpoint:
    """The published policy (one read of ``current.json``), else the base model at ``base``."""
    pointer = fsio.read_record(layout.current_checkpoint)
    return Checkpoint(layout.root / pointer["path"], pointer["iteration"]) if pointer else Checkpoint(Path(base), 0)


def publish(layout: RunLayout, iteration: int) -> Checkpoint:
    """Point ``current.json`` at the checkpoint of ``iteration`` (which must be in place)."""
    final = layout.checkpoint(iteration)
    if not final.is_dir():
        raise FileNotFoundError(f"checkpoint {final} of iteration {iteration} is missing; training did not finish")
    fsio.write_record(layout.current_checkpoint, {"iteration": iteration, "path": str(final.relative_to(layout.root))})
    return Checkpoint(final, iteration)


def exists(layout: RunLayout, iteration: int) -> bool:
    """Whether the checkpoint of ``iteration`` is in place (as seen after a fresh look)."""
    final = layout.checkpoint(iteration)
    fsio.refresh_dir(final.parent)  # every rank must see a checkpoint an earlier attempt renamed into place
    return final.is_dir()


def new_staging(layout: RunLayout, iteration: int, attempt_id: str, round_: int) -> Path:
    """An empty staging directory for this try of ``iteration``'s checkpoint."""
    staging = layout.checkpoint_staging(iteration, attempt_id, round_)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def place(layout: RunLayout, iteration: int, staging: Path) -> Path:
    """Seal ``staging`` (every shard an index names must be there: other nodes write some) and
    rename it into place as the checkpoint of ``iteration``; the other tries' stagings go."""
    final = layout.checkpoint(iteration)
    manifest.seal(staging)
    fsio.fsync_dir(staging)
    os.replace(staging, final)
    fsio.fsync_dir(final.parent)
    return final


def remove_stagings(layout: RunLayout, iteration: int) -> list[Path]:
    """Once the checkpoint is in place, the staging directories of the tries that never got
    there: an attempt that crashed in training, a round a lost rank cut short (elastic)."""
    left = layout.checkpoint_stagings(iteration)
    for staging in left:
        shutil.rmtree(staging, ignore_errors=True)
    return left
