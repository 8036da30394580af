"""`orchestrator config`: every key `valid_override_keys()` accepts, once, with its type
(bounds included), default and the first sentence of its field's docstring; `--json` for
scripts; a prefix keeps some keys."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from orchestrator import config
from orchestrator.cli import cli
from orchestrator.cli.config import first_sentence


def _config(*args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it: no colour, 80 columns."""
    return subprocess.run([sys.executable, "-m", "orchestrator", "config", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NO_COLOR": "1", "COLUMNS": "80"})


@pytest.fixture(scope="module")
def listing() -> str:
    result = _config()
    assert result.returncode == 0, result.stderr
    return result.stdout


def _json(*args: str) -> list[dict]:
    result = CliRunner().invoke(cli, ["config", "--json", *args], prog_name="orchestrator")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _keys_listed(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line.startswith("  ") and not line.startswith("   ")]


def test_every_valid_key_is_listed_once_in_order(listing):
    assert _keys_listed(listing) == config.valid_override_keys()


def test_the_listing_fits_80_columns(listing):
    assert [line for line in listing.splitlines() if len(line) > 80] == []


def test_each_section_s_types_line_up_and_its_description_is_indented_under_it(listing):
    """A section's description folds under its heading, never to column 0; within a section
    every key's type starts in one column (a choice too long for it is listed under its key)."""
    import re

    section, starts = None, {}
    for line in listing.splitlines():
        if line and not line.startswith(" "):
            section = line.split(":")[0]
            assert line.startswith(section), line
            continue
        if line.startswith("  ") and not line.startswith("   "):
            starts.setdefault(section, set()).add(re.match(r"  \S+\s+", line).end())
    assert {s: c for s, c in starts.items() if len(c) != 1} == {}
    assert "  rl.loss_agg" in listing and "one of: token_mean, seq_mean_token_sum, seq_mean_token_mean" in listing
    heading_lines = [i for i, line in enumerate(listing.splitlines()) if line.startswith("checkpoint:")]
    assert listing.splitlines()[heading_lines[0] + 1].startswith("    "), "the description folds under its heading"


def test_keys_are_grouped_under_each_section_of_the_run_config(listing):
    sections = [f.name for f in dataclasses.fields(config.RunConfig) if dataclasses.is_dataclass(f.default_factory)]
    headings = [line.split(":")[0] for line in listing.splitlines()
                if line and not line.startswith(" ") and line.split(":")[0] in {"(top level)", *sections}]
    assert headings == ["(top level)", *sections]


def test_a_field_with_a_docstring_shows_its_first_sentence(listing):
    flat = " ".join(listing.split())
    assert "coordination.heartbeat_interval_s float > 0 5.0 How often each rank rewrites its heartbeat counter. " in flat
    assert "At most node_timeout_s / 4." not in flat, "only the first sentence"
    for entry in _json():
        if entry["help"]:
            assert first_sentence(entry["help"]) in flat, entry["key"]


def test_a_field_without_a_docstring_shows_its_type_and_default_only(listing):
    lines = listing.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rl.top_p"])
    assert lines[at].split() == ["rl.top_p", "float", "in", "(0,", "1]", "1.0"]
    assert lines[at + 1].split()[0] == "rl.max_prompt_tokens"


def test_json_has_type_default_and_help_for_every_key():
    entries = _json()
    assert [e["key"] for e in entries] == config.valid_override_keys()
    assert all(set(e) == {"key", "type", "default", "help"} and e["type"] for e in entries)
    by_key = {e["key"]: e for e in entries}
    assert by_key["rl.top_p"]["type"] == "float in (0, 1]"
    assert by_key["checkpoint.keep_last"] == {"key": "checkpoint.keep_last", "type": "int >= 1", "default": 3,
                                              "help": "The newest checkpoints kept, the current one among them; at least 1."}
    assert by_key["train.strategy"]["type"] == "ddp|fsdp"
    assert by_key["data.train_file"]["type"] == "str, non-empty"
    assert (by_key["rl.stop"]["type"], by_key["rl.stop"]["default"]) == ("list[str]", [])
    assert by_key["coordination.master_wait_s"]["default"] is None
    assert by_key["seed"]["help"] == "Seeds task sampling and everything random in the run."


def test_the_defaults_are_the_ones_a_run_gets():
    built = config.build_sections(config.parse_overrides([]))
    for e in _json():
        section, _, name = e["key"].rpartition(".")
        if section == config.MODEL_KEY.rstrip("."):  # a models.<name> section: what a named one gets
            assert getattr(config.AuxModelConfig(), name) == e["default"], e["key"]
            continue
        value = getattr(built[section], name) if section else config.RunConfig.__dataclass_fields__[name].default
        assert e["default"] == value, e["key"]


def test_a_prefix_keeps_the_keys_that_start_with_it():
    assert {e["key"] for e in _json("rl")} == {k for k in config.valid_override_keys() if k.startswith("rl.")}
    assert [e["key"] for e in _json("rl.clip")] == ["rl.clip_eps", "rl.clip_eps_low", "rl.clip_eps_high"]


def test_one_key_alone_is_shown_with_its_whole_description():
    result = _config("coordination.heartbeat_interval_s")
    assert result.returncode == 0, result.stderr
    assert " ".join(result.stdout.split()) == ("coordination coordination.heartbeat_interval_s float > 0 5.0 How often each rank "
                                               "rewrites its heartbeat counter. At most node_timeout_s / 4.")


def test_an_unknown_prefix_exits_2_naming_the_closest_keys():
    result = _config("rl.lrr")
    assert result.returncode == 2
    assert "no config key starts with 'rl.lrr': did you mean rl.lr, rl.reward or rl.eval_reward?" in result.stderr


@pytest.mark.parametrize("text,sentence", [
    ("One. Two.", "One."),
    ("Seconds, 0.5 of it. Then more.", "Seconds, 0.5 of it."),
    ('vLLM: more serve arguments, as one shell-quoted string (e.g. "--enforce-eager").',
     'vLLM: more serve arguments, as one shell-quoted string (e.g. "--enforce-eager").'),
    ("In memory across iterations. false: a new one each time.", "In memory across iterations. false: a new one each time."),
    ("No period", "No period"),
])
def test_the_first_sentence_ends_at_a_period_outside_brackets(text, sentence):
    assert first_sentence(text) == sentence
