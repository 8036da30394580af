"""The one CLI: `orchestrator run|local|status|stop|recover|report|doctor|plan|demo-data` (one module per command)."""

from __future__ import annotations

import click

from orchestrator import __version__
from orchestrator.cli.demo_data import demo_data
from orchestrator.cli.doctor import doctor
from orchestrator.cli.local import local
from orchestrator.cli.plan import plan
from orchestrator.cli.recover import recover
from orchestrator.cli.report import report
from orchestrator.cli.run import run
from orchestrator.cli.status import status
from orchestrator.cli.stop import stop


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="orchestrator")
def cli() -> None:
    """Multi-node RL over a shared filesystem: every barrier, heartbeat and hand-off is a file."""


cli.add_command(run)
cli.add_command(local)
cli.add_command(status)
cli.add_command(stop)
cli.add_command(demo_data)
cli.add_command(plan)
cli.add_command(recover)
cli.add_command(report)
cli.add_command(doctor)


def main() -> None:
    cli(prog_name="orchestrator")
