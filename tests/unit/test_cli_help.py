"""Every command's --help as a user reads it, without colour at 80 columns: path options say
PATH, the rank flags name every variable cli/rank.py reads, a default is written once and
in one form, and bare `orchestrator` is its help with exit 0."""

import re

import click
import pytest
from click.testing import CliRunner

from orchestrator.cli import cli

COMMANDS = sorted(cli.commands)


def _invoke(*args: str):
    return CliRunner(env={"NO_COLOR": "1", "COLUMNS": "80"}).invoke(cli, list(args), prog_name="orchestrator", terminal_width=80)


def _help(command: str) -> str:
    result = _invoke(command, "--help")
    assert result.exit_code == 0, result.output
    return result.output


def _options(command: str) -> list[tuple[click.Option, str]]:
    """Each option of ``command`` with its help record as --help prints it (flags, text)."""
    cmd = cli.commands[command]
    ctx = click.Context(cmd, info_name=command, terminal_width=80)
    return [(p, " ".join(p.get_help_record(ctx))) for p in cmd.params if isinstance(p, click.Option) and p.get_help_record(ctx)]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_fits_80_columns(command):
    assert [line for line in _help(command).splitlines() if len(line) > 80] == []


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_option_shows_PATH_not_TEXT(command):
    text = _help(command)
    assert not re.search(r"--[\w-]*path TEXT", text)
    for option, record in _options(command):
        if option.name.endswith("path"):
            assert isinstance(option.type, click.Path), f"{command} {option.opts[0]}"
            assert record.startswith(f"{option.opts[0]} PATH")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_default_is_written_once_in_clicks_form(command):
    for option, record in _options(command):
        assert record.count("[default:") <= 1, record
        assert "(default" not in record and "Default:" not in record and "; default:" not in record, record


@pytest.mark.parametrize("command", [c for c in COMMANDS if any(o.name == "worker" for o, _ in _options(c))])
def test_the_worker_help_names_every_variable_a_rank_comes_from(command):
    record = dict((o.name, r) for o, r in _options(command))["worker"]
    assert "else env RANK, then NODE_RANK, then SLURM_PROCID" in " ".join(record.split())


def test_doctor_and_run_share_the_rank_flags():
    assert {"master", "worker"} <= {o.name for o, _ in _options("doctor")}
    assert dict((o.name, r) for o, r in _options("doctor"))["worker"] == dict((o.name, r) for o, r in _options("run"))["worker"]


def test_demo_data_says_each_default_once():
    text = " ".join(_help("demo-data").split())
    assert "[default: 0.3,0.4]" in text and text.count("0.3,0.4") == 1
    assert "[default: 1500]" in text and text.count("1500") == 1
    assert "; with --chat" not in text


def test_bare_orchestrator_prints_its_help_and_exits_0():
    result = _invoke()
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: orchestrator [OPTIONS] [COMMAND] [ARGS]...")
    listed = result.output.split("Commands:\n", 1)[1]
    assert [line.split()[0] for line in listed.splitlines() if line.startswith("  ") and not line.startswith("   ")] == COMMANDS


def test_the_command_list_shows_each_summary_whole():
    result = _invoke("--help")
    assert "..." not in result.output.split("Commands:", 1)[1]
    assert "(with --chat, a Qwen2-style chat model) under --data-path." in " ".join(result.output.split())


def test_an_unknown_command_is_still_an_error():
    result = _invoke("nosuch")
    assert result.exit_code == 2 and "No such command 'nosuch'" in result.output
