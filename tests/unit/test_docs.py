"""The docs stand on their own: every relative link in README.md and docs/ resolves (the file
exists, and a ``#section`` names one of its headings), and no page points at files outside the
repository or at the project's issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
# What only the project's own tracker or its private notes would explain to a reader.
_OUTSIDE = re.compile(r"SHARED-FS|SPEC(?:\.md| section| invariant|\b \d)|\.\./shared|\bseeds/|\bseed 00\d|\b[Ii]ssue \d+")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _FENCE.sub("", page.read_text(encoding="utf-8")))  # code is not a link
    return [a or b for a, b in _LINK.findall(text)]


def test_the_slug_matches_githubs():
    assert _slug("Measured on the test machine") == "measured-on-the-test-machine"
    assert _slug("5. Fencing (attempts)") == "5-fencing-attempts"
    assert _slug("The `status --json` schema") == "the-status---json-schema"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_points_outside_the_repository(page):
    hits = [f"line {n}: {line.strip()}" for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if _OUTSIDE.search(line)]
    assert not hits, f"{page.name} cites what a reader of the repository cannot open:\n" + "\n".join(hits)


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\nSee [b](b.md) and [here](#nowhere) and [c](a.md#title), not `f[x](y)`.\n")
    assert links(tmp_path / "a.md") == ["b.md", "#nowhere", "a.md#title"]
    assert anchors(tmp_path / "a.md") == {"title"}


def test_the_architecture_pages_module_table_is_each_modules_opening_docstring():
    from tests import module_table

    assert module_table.on_page() is not None, f"{module_table.PAGE.name} lacks the module table's markers"
    assert module_table.on_page() == module_table.render(), (
        "docs/architecture.md's module table differs from the modules' docstrings: run python3 -m tests.module_table --write")


def test_the_readme_lists_every_doc():
    index = re.findall(r"^- \[docs/([\w.-]+\.md)\]", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in index]
    assert not missing, f"README.md's doc index leaves out {', '.join(missing)}"

