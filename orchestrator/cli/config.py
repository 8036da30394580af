"""`orchestrator config`: every key a KEY=VALUE override may set, with its type, default and
meaning, read from the dataclasses the run validates against (``orchestrator/config.py``):
the keys are ``config.valid_override_keys()``, the types carry the same constraints, and the
meaning is each field's docstring (the string literal under it)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap

import click
from rich.text import Text

from orchestrator import config, terminal
from orchestrator.errors import EXIT_BAD_INPUT

TOP_LEVEL = "(top level)"
"""The heading of the keys outside every section (``seed``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    key: str
    type: str
    default: object
    help: str
    """The field's docstring as one paragraph; "" when it has none."""

    @property
    def section(self) -> str:
        return self.key.rpartition(".")[0] or TOP_LEVEL

    @property
    def summary(self) -> str:
        return first_sentence(self.help)


def keys() -> list[Key]:
    """Every overridable key, in the order ``valid_override_keys()`` lists them."""
    described = []
    for key, (cls, f, hint) in config.override_fields().items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        described.append(Key(key, config.describe_type(hint), default, field_docs(cls).get(f.name) or f.metadata.get("help", "")))
    return described


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` or of a dataclass it derives from
    (the trainer's settings: train/settings.py), as one paragraph; {} for a class whose source
    cannot be read (one made by ``dataclasses.make_dataclass``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        docs |= {
            stmt.target.id: " ".join(doc.value.value.replace("``", "").split())
            for stmt, doc in zip(body, body[1:])
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
        }
    return docs


def section_doc(cls: type) -> str:
    """The class docstring of a section, "" when it has none (dataclass writes its signature there)."""
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def first_sentence(text: str) -> str:
    """Up to the first period that ends a sentence: outside brackets (``(e.g. "x")``) and
    followed by the end or by a word that does not start in lowercase (``0.5``, ``e.g. x``)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "." and depth <= 0 and (i + 1 == len(text) or (text[i + 1] == " " and not text[i + 2:i + 3].islower())):
            return text[:i + 1]
    return text


def shown(value: object) -> str:
    """A default as it would be written in an override (``true``, ``""``, ``[]``)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


@click.command("config")
@click.argument("prefix", required=False, default="")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of {key, type, default, help}.")
def config_command(prefix: str, as_json: bool) -> None:
    """List every config key a KEY=VALUE argument of `run`, `local` or `plan` may set, with
    its type, default and meaning.

    PREFIX keeps the keys that start with it (rl, rl.clip, coordination.node); one key
    alone is shown with its whole description.
    """
    chosen = [k for k in keys() if k.key.startswith(prefix)]
    if not chosen:
        terminal.abort(f"no config key starts with {prefix!r}: {config.unknown_key_hint(prefix)}", EXIT_BAD_INPUT)
    if as_json:
        terminal.out.print(json.dumps([{"key": k.key, "type": k.type, "default": k.default, "help": k.help} for k in chosen],
                                      indent=2), markup=False)
        return
    classes = config.override_fields()
    sections: dict[str, list[Key]] = {}
    for k in chosen:
        sections.setdefault(k.section, []).append(k)
    width = terminal.out.width
    for n, (section, entries) in enumerate(sections.items()):
        if n:
            terminal.out.print()
        doc = section_doc(classes[entries[0].key][0]) if section != TOP_LEVEL else ""
        head = textwrap.wrap(f"{section}: {doc}" if doc else section, width=width, subsequent_indent="    ", break_on_hyphens=False)
        terminal.out.print(Text.assemble((section, "bold"), head[0][len(section):]))
        _lines(head[1:], 0)
        key_width = max(len(k.key) for k in entries)
        # A choice too long for the aligned columns is listed under its key, "choice" in its column.
        long_choice = {k.key for k in entries if "|" in k.type and 2 + key_width + 2 + len(k.type) + 2 + len(shown(k.default)) > width}
        type_of = {k.key: "choice" if k.key in long_choice else k.type for k in entries}
        type_width = max(len(t) for t in type_of.values())
        for k in entries:
            default, type_ = shown(k.default), type_of[k.key]
            # Aligned columns; a default too long for the line goes under it, wrapped.
            fits = 2 + key_width + 2 + type_width + 2 + len(default) <= width
            row = Text.assemble("  ", (k.key.ljust(key_width), "bold cyan"), "  ", (type_.ljust(type_width), "dim"), "  ",
                                default if fits else "")
            row.rstrip()
            terminal.out.print(row)
            if not fits:
                _lines(textwrap.wrap(f"default: {default}", width=max(width - 6, 40), break_on_hyphens=False), 6)
            if k.key in long_choice:
                _lines(textwrap.wrap(f"one of: {', '.join(k.type.split('|'))}", width=max(width - 6, 40), break_on_hyphens=False), 6)
            _lines(textwrap.wrap(k.help if len(chosen) == 1 else k.summary, width=max(width - 6, 40), break_on_hyphens=False), 6)


def _lines(lines: list[str], indent: int) -> None:
    for line in lines:
        terminal.out.print(" " * indent + line, markup=False)
