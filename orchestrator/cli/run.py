"""`orchestrator run`: one rank of a run (what scripts/run.sh execs on every node)."""

from __future__ import annotations

import sys

import click

from orchestrator import preflight, terminal
from orchestrator.cli.run_options import RANK_OPTIONS, RUN_OPTIONS, ConfigError, apply, build_config
from orchestrator.errors import EXIT_BAD_INPUT
from orchestrator.node import identity
from orchestrator.protocol import faults


@click.command(context_settings={"ignore_unknown_options": False})
@apply(RUN_OPTIONS + RANK_OPTIONS)
def run(**params) -> None:
    """Run one rank. Extra KEY=VALUE arguments override dotted config keys (`orchestrator
    config` lists them)."""
    try:
        config = build_config(params)
        preflight.create_log_path(config.log_path)
    except ConfigError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    try:
        faults.from_env()
    except ValueError as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    terminal.setup_logging(config.rank, identity.host())
    from orchestrator import workloads
    from orchestrator.runtime.runner import Rank

    tracker = None
    if config.is_master and config.tracking.backends:
        from orchestrator.tracking.tracker import Tracker

        tracker = Tracker(config)
    sys.exit(Rank(config, workloads.make, tracker=tracker).run())
