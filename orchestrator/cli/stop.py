"""`orchestrator stop`: ask every rank to stop at the next phase boundary."""

from __future__ import annotations

import time
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR
from orchestrator.node import identity
from orchestrator.protocol import fsio, lease
from orchestrator.protocol.layout import RunLayout


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
def stop(log_path: Path) -> None:
    """Stop the run gracefully: every rank ends after the next barrier, resumable later."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    layout = RunLayout(log_path)
    current = lease.read_lease(layout)
    if current is None or current.released:
        terminal.abort(f"no run is in progress under {log_path}", EXIT_ERROR)
    fsio.write_record(layout.attempt(current.attempt).stop, {**identity.me(), "at": time.time()})
    terminal.out.print(
        f"stop requested for attempt {current.attempt} (master {current.host}, pid {current.pid}); "
        f"ranks stop after the next barrier. Re-run the same commands to continue."
    )
