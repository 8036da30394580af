"""The one CLI: `orchestrator run|local|status|stop|recover|report|export|doctor|plan|config|demo-data` (one module per command)."""

from __future__ import annotations

import click

from orchestrator import __version__
from orchestrator.cli.config import config_command
from orchestrator.cli.demo_data import demo_data
from orchestrator.cli.doctor import doctor
from orchestrator.cli.export import export
from orchestrator.cli.local import local
from orchestrator.cli.plan import plan
from orchestrator.cli.recover import recover
from orchestrator.cli.report import report
from orchestrator.cli.run import run
from orchestrator.cli.status import status
from orchestrator.cli.stop import stop


class _Group(click.Group):
    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with its first sentence whole, wrapped (click cuts it to the line)."""
        rows = [(name, cmd.get_short_help_str(limit=1000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_Group, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="orchestrator")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Multi-node RL over a shared filesystem: every barrier, heartbeat and hand-off is a file."""
    if ctx.invoked_subcommand is None:  # asking for help is not an error (click exits 2 there)
        click.echo(ctx.get_help())


cli.add_command(run)
cli.add_command(local)
cli.add_command(status)
cli.add_command(stop)
cli.add_command(demo_data)
cli.add_command(plan)
cli.add_command(recover)
cli.add_command(report)
cli.add_command(export)
cli.add_command(doctor)
cli.add_command(config_command)


def main() -> None:
    cli(prog_name="orchestrator")
