"""The README and docs/ hold together: the README stays a ten-minute start (short, its
Quickstart the two commands CI and a fresh clone run), every relative link and heading
anchor in README.md and docs/*.md resolves, the README links every docs page, and
docs/commands.md has a section for every subcommand of ``rdepc`` with every option its
parser takes. The subcommands come from the parser itself (``rdepc.cli.build_parser``),
which imports neither torch nor triton."""

from __future__ import annotations

import argparse
import re
import unicodedata
from pathlib import Path

import pytest
from conftest import ROOT

README_MAX_LINES = 250
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def quickstart_lines(text: str) -> list[str]:
    """The non-empty lines of the first fenced block after ``## Quickstart``, as CI's
    ``awk '/^## Quickstart/{q=1;next} q&&/^```/{if(f){exit}f=1;next} q&&f&&NF{print}'`` reads them."""
    lines, seen, inside = [], False, False
    for line in text.splitlines():
        if not seen:
            seen = line.startswith("## Quickstart")
            continue
        if line.startswith("```"):
            if inside:
                break
            inside = True
            continue
        if inside and line.split():
            lines.append(line)
    return lines


def unfenced(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans, where brackets are not links."""
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", unfenced(text), flags=re.S)


LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def links(text: str) -> list[str]:
    body = prose(text)
    return LINK.findall(body) + REFERENCE.findall(body)


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # https:, mailto:, ...


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code spans and links reduced to their text,
    every character but letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in unfenced(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, fragment = target.partition("#")
    return (page.parent / path).resolve() if path else page, fragment


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move reference material into docs/"


def test_readme_quickstart_is_the_two_commands():
    lines = quickstart_lines((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(lines) == 2, f"the Quickstart's first fenced block must hold exactly two commands, found {lines}"
    assert "rdepc check" in lines[0], lines[0]
    assert "pytest" in lines[1], lines[1]


def test_quickstart_reader_matches_the_ci_awk():
    text = "x\n## Quickstart\n\nprose\n```\none rdepc check\n\ntwo pytest\n```\n```\nthree\n```\n"
    assert quickstart_lines(text) == ["one rdepc check", "two pytest"]
    assert quickstart_lines("## Quick\n```\na\n```\n") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in links(text):
        if is_external(target) or target.startswith("#"):
            continue
        path, _ = resolve(page, target)
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_anchors_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in links(text):
        if is_external(target) or "#" not in target:
            continue
        path, fragment = resolve(page, target)
        if path.suffix != ".md" or not path.is_file():
            continue  # a missing file is test_relative_links_resolve's
        if fragment not in anchors(path.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: anchors with no heading: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = ROOT / "README.md"
    linked = {resolve(readme, target)[0] for target in links(readme.read_text(encoding="utf-8"))}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md's list of docs links none of {unlinked}"


def test_link_reader():
    text = (
        '[a](docs/a.md) ![b](img/b.png "t") [c](#here) [d](https://x.y/z) `[e](no.md)`\n'
        "```\n[f](no.md)\n```\n[g]: ../g/\n## Here `code` [link](x.md)\n"
    )
    assert links(text) == ["docs/a.md", "img/b.png", "#here", "https://x.y/z", "x.md", "../g/"]
    assert anchors(text) == {"here-code-link"}
    assert slug("`rdepc check`") == "rdepc-check"
    assert slug("Training with torch.distributed") == "training-with-torchdistributed"
    assert slug("7. A complete example") == "7-a-complete-example"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from rdepc.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


COMMON = {"-h", "--help", "--layer", "-D"}  # every spec command's: the page's common section


def command_sections(text: str) -> dict[str, str]:
    """docs/commands.md's ``## `rdepc NAME` `` sections, each up to the next ``## ``."""
    parts = re.split(r"^## ", text, flags=re.M)
    sections = {}
    for part in parts[1:]:
        m = re.match(r"`?rdepc (\w[\w-]*)`?\s*\n", part)
        if m:
            sections[m.group(1)] = part
    return sections


def test_every_subcommand_has_a_section_with_its_options():
    text = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    sections = command_sections(text)
    commands = subcommands()
    assert commands, "no subcommands found in rdepc.cli.build_parser"
    missing = sorted(set(commands) - set(sections))
    assert not missing, f"docs/commands.md has no '## `rdepc NAME`' section for {missing}"
    for name, parser in commands.items():
        body = sections[name]
        options = {s for a in parser._actions for s in a.option_strings} - COMMON
        absent = sorted(o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", body))
        assert not absent, f"docs/commands.md's section for rdepc {name} does not mention {absent}"
        for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
            for action in sub.choices:
                assert f"rdepc {name} {action}" in body, f"rdepc {name} {action} is not in its section"
    for option in ("--layer", "-D NAME=VALUE", "--debug", "--version"):
        assert option in text, f"docs/commands.md does not mention {option}"


def test_every_test_file_has_one_tier():
    """tests/tiers.py places every test file in exactly one tier, so that ``pytest -m TIER``
    runs each test in one tier and a new file cannot be left out of them all."""
    from tiers import TIERS

    files = sorted(p.stem for p in (ROOT / "tests").glob("test_*.py"))
    placed = [name for names in TIERS.values() for name in names]
    assert sorted(placed) == files, (set(files) ^ set(placed), [n for n in placed if placed.count(n) > 1])


def test_property_tests_draw_no_constant_of_what_a_worker_imported(tmp_path, monkeypatch):
    """Hypothesis draws from the strategies as written (conftest): a local module imported
    during the suite (a generated kernel file) adds no constant to its draws, so a property
    test draws the same examples whichever tests its worker ran before it."""
    import importlib

    from conftest import NO_CONSTANTS
    from hypothesis.internal.conjecture.providers import HypothesisProvider

    (tmp_path / "rdepc_suite_local.py").write_text("MARK = 987654321\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("rdepc_suite_local")
    drawn = HypothesisProvider(None)._local_constants
    assert drawn is NO_CONSTANTS and len(drawn) == 0
