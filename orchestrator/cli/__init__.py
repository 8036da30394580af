"""The one CLI: `orchestrator run|local|status|stop|recover|report|export|doctor|plan|config|demo-data` (one module per command)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

import click

from orchestrator import __version__
from orchestrator.node import collector

# Each command's module, imported when the command is looked up: `orchestrator run`, which
# every rank (and `local` for each of its ranks) starts with, loads neither the others nor
# what they import (doctor's probes, config's tables, recover's and status's readers).
COMMANDS = {
    "run": "orchestrator.cli.run:run",
    "local": "orchestrator.cli.local:local",
    "status": "orchestrator.cli.status:status",
    "stop": "orchestrator.cli.stop:stop",
    "demo-data": "orchestrator.cli.demo_data:demo_data",
    "plan": "orchestrator.cli.plan:plan",
    "recover": "orchestrator.cli.recover:recover",
    "report": "orchestrator.cli.report:report",
    "export": "orchestrator.cli.export:export",
    "doctor": "orchestrator.cli.doctor:doctor",
    "config": "orchestrator.cli.config:config_command",
}


class _Commands(MutableMapping):
    """click's ``Group.commands``: by name, "module:attribute" until first looked up, then the command."""

    def __init__(self, where: dict[str, str]) -> None:
        self._items: dict[str, str | click.Command] = dict(where)

    def __getitem__(self, name: str) -> click.Command:
        item = self._items[name]
        if isinstance(item, str):
            module, attribute = item.split(":")
            item = self._items[name] = getattr(importlib.import_module(module), attribute)
        return item

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._items[name] = command

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class _Group(click.Group):
    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with its first sentence whole, wrapped (click cuts it to the line)."""
        rows = [(name, cmd.get_short_help_str(limit=1000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_Group, commands=_Commands(COMMANDS), invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="orchestrator")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Multi-node RL over a shared filesystem: every barrier, heartbeat and hand-off is a file."""
    if ctx.invoked_subcommand is None:  # asking for help is not an error (click exits 2 there)
        click.echo(ctx.get_help())


def main() -> None:
    """The command line, as ``python -m orchestrator`` and the ``orchestrator`` script run it: its
    collector tuned first, as the commands import torch and transformers only when they run."""
    collector.tune()
    cli(prog_name="orchestrator")
