"""`orchestrator stop`: ask every rank to stop at the next phase boundary."""

from __future__ import annotations

import time
from pathlib import Path

import click

from orchestrator import terminal
from orchestrator.errors import EXIT_BAD_INPUT, EXIT_ERROR
from orchestrator.node import identity
from orchestrator.protocol import fsio, lease, schema
from orchestrator.protocol.wire import HeartbeatState
from orchestrator.protocol.layout import RunLayout


@click.command()
@click.option("--log-path", required=True, type=click.Path(path_type=Path), help="The run's --log-path.")
def stop(log_path: Path) -> None:
    """Stop the run gracefully: every rank ends after the next barrier, resumable later.
    Exit 0 also when the run has finished or is stopped already; 1 when no run is there
    or its last attempt failed."""
    if not log_path.is_absolute():
        terminal.abort(f"--log-path must be absolute, got {log_path}", EXIT_BAD_INPUT)
    layout = RunLayout(log_path)
    current = lease.read_lease(layout)
    if current is None:
        terminal.abort(f"no run is in progress under {log_path}: no master has started one there", EXIT_ERROR)
    if current.released:
        _nothing_to_stop(layout, current)
        return
    fsio.write_record(layout.attempt(current.attempt).stop, {**identity.me(), "at": time.time()})
    terminal.out.print(
        f"stop requested for attempt {current.attempt} (master {current.host}, pid {current.pid}); "
        f"ranks stop after the next barrier. Re-run the same commands to continue."
    )


def _nothing_to_stop(layout: RunLayout, current: lease.Lease) -> None:
    """The master released the lease: its last attempt is over. Asking to stop a run that
    finished, or was stopped already, is not an error; one that failed is named as such."""
    master = fsio.read_record(layout.attempt(current.attempt).heartbeat(0)) or {}
    progress = schema.read(layout.progress, schema.Progress)
    where = f" (iteration {progress.iteration}, phase {progress.phase.label})" if progress else ""
    state = master.get("state")
    if state == HeartbeatState.DONE:
        terminal.out.print(f"the run under {layout.root} has finished{where}: nothing to stop", markup=False)
    elif state == HeartbeatState.STOPPED:
        terminal.out.print(f"the run under {layout.root} is stopped already{where}: nothing to stop. Re-run the same commands "
                           f"to continue.", markup=False)
    else:
        terminal.abort(f"no run is in progress under {layout.root}: attempt {current.attempt} ended ({state or 'no master heartbeat'})"
                       f"{where}; `orchestrator status --log-path {layout.root}` says why", EXIT_ERROR)
