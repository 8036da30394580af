"""`orchestrator run`: one rank of a run (what scripts/run.sh execs on every node)."""

from __future__ import annotations

import logging
import sys

import click

from orchestrator import preflight, terminal
from orchestrator.cli.run_options import RANK_OPTIONS, RUN_OPTIONS, ConfigError, apply, build_config
from orchestrator.data import run_keys
from orchestrator.errors import EXIT_BAD_INPUT, BadInput
from orchestrator.node import identity, rank_lock
from orchestrator.protocol import faults


@click.command(context_settings={"ignore_unknown_options": False})
@apply(RUN_OPTIONS + RANK_OPTIONS)
def run(**params) -> None:
    """Run one rank. Extra KEY=VALUE arguments override dotted config keys (`orchestrator
    config` lists them)."""
    try:
        config = build_config(params)
        faults.from_env()
    except ValueError as e:  # a ConfigError, or a bad ORCHESTRATOR_FAULT
        terminal.abort(str(e), EXIT_BAD_INPUT)
    try:
        # Before the run's first write (its directory, the lease, a join, a log): the same
        # rank started twice on this host ends here, at once, however long a lease takes.
        held = rank_lock.claim(config.log_path, config.rank)
        preflight.create_log_path(config.log_path)
    except (ConfigError, BadInput) as e:
        terminal.abort(str(e), EXIT_BAD_INPUT)
    with held:  # for the rank's life; the kernel drops it if the process is killed
        terminal.setup_logging(config.rank, identity.host())
        if config.keys_from_data:
            logging.getLogger(__name__).info("%s: taken from %s (the command line does not set %s)", " ".join(config.keys_from_data),
                                             run_keys.path(config.data_path),
                                             "it" if len(config.keys_from_data) == 1 else "them")
        from orchestrator import workloads
        from orchestrator.runtime.runner import Rank

        tracker = None
        if config.is_master and config.tracking.backends:
            from orchestrator.tracking.tracker import Tracker

            tracker = Tracker(config)
        sys.exit(Rank(config, workloads.make, tracker=tracker).run())
