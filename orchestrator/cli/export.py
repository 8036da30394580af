"""`orchestrator export`: the policy of one iteration as a plain Hugging Face model directory
(a LoRA adapter merged into its base)."""

from __future__ import annotations

from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.checkpoints import CheckpointCorrupt
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR, BadInput
from orchestrator.checkpoints import export as export_mod


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
@click.option("--iteration", type=click.IntRange(min=1), default=None,
              help="The iteration whose checkpoint to export.  [default: the current policy]")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="New directory for the model (must not exist, or be empty).")
@click.option("--base-model", type=click.Path(path_type=Path), default=None,
              help="With LoRA: the base model directory the adapter applies to.  [default: the one its adapter_config.json names]")
def export(log_path: Path, iteration: int | None, out: Path, base_model: Path | None) -> None:
    """Write a run's policy as a Hugging Face model directory (LoRA adapters merged); it only reads the run."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    if not log_path.is_dir():
        terminal.abort(f"--log-path {log_path} is not a directory", EXIT_BAD_INPUT)
    try:
        done = export_mod.export(log_path, iteration, out.absolute(), base_model.absolute() if base_model else None)
    except BadInput as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    except CheckpointCorrupt as e:
        terminal.abort(str(e), EXIT_ERROR)
    except OSError as e:
        terminal.abort(f"could not export: {e}", EXIT_ERROR)
    how = (f"the LoRA adapter merged into {done.merged_from}" if done.merged_from else
           "copied, with its fp32 master weights in place of the 16-bit ones the engines read" if done.master else
           "rebuilt from its chain of deltas, in the dtype the engines read: its training state (the fp32 master) was not kept"
           if done.rebuilt else "copied")
    terminal.out.print(f"exported iteration {done.iteration} ({done.source}, {how}) to {done.out}: {done.bytes / 1e6:.1f} MB",
                       markup=False)
