"""docs/architecture.md's module table, made from each module's opening docstring: one row a
module, in layer order (tests/unit/test_layers.py), with the first sentence of its docstring.
``tests/unit/test_docs.py`` fails when the page differs; ``python3 -m tests.module_table --write``
writes it."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.unit.test_layers import ROOT, _layer, _modules

PAGE = ROOT.parent / "docs" / "architecture.md"
BEGIN = "<!-- module table: made by `python3 -m tests.module_table --write` from each module's opening docstring -->"
END = "<!-- end of the module table -->"


def first_sentence(docstring: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    text = " ".join(docstring.split("\n\n")[0].split()).replace("|", "\\|")
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(\s|$)", text)
    return text[: match.start() + 1] if match else text


def rows() -> list[tuple[int, str, str]]:
    """(layer, path relative to orchestrator/, first sentence) of every module, in layer order."""
    out = []
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert doc, f"{path} has no opening docstring: say what the module holds"
        out.append((_layer(name), path.relative_to(ROOT).as_posix(), first_sentence(doc)))
    return sorted(out, key=lambda r: (r[0], r[1].count("/"), r[1]))


def render() -> str:
    lines = [BEGIN, "", "| layer | module | what it holds |", "|---|---|---|"]
    lines += [f"| {layer} | `{path}` | {sentence} |" for layer, path, sentence in rows()]
    return "\n".join(lines + ["", END])


def on_page() -> str | None:
    text = PAGE.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN): text.index(END) + len(END)]


def write() -> None:
    text = PAGE.read_text(encoding="utf-8")
    PAGE.write_text(text.replace(on_page(), render()), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(render())
