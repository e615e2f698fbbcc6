"""The docs are organised by topic and point only at what exists: no heading names a tracker issue, no page writes a
path of a development machine, and every reference to a docs page, from the code or between pages, resolves.

* A heading (README.md, CONTRIBUTING.md, docs/*.md; not inside code blocks) says what its section measures or
  describes: ``issue 12``, ``issue #12`` or ``#12`` in it fails. Prose may still tell the history.
* No page writes ``/work/…``, ``/tmp/…``, ``/root/…`` or ``/home/…``: a reader's machine has none of a developer's
  folders, so commands write ``runs/…`` or ``$OUT/…``. System paths users really have (``/etc/mosquitto/…``,
  ``/usr/share/…``, ``/dev/…``) stay; no allow-list is needed.
* The code (feast_edge/, server/, device_agent/; strings and comments) cites pages as ``docs/X.md``, optionally
  followed by ``#anchor``, ``§N`` / ``§N.M`` and a quoted section name (``docs/X.md, "Title"``,
  ``docs/X.md "Title"``, ``docs/X.md ("Title")``, ``docs/X.md §7 "Title"``). The page must exist; the anchor must be
  a heading's slug (as mkdocs or GitHub writes it); ``§N.M`` must be a heading that starts with ``N.M``; the quoted
  name must be a heading's text (backticks and case ignored), with or without its section number, or the part of
  it before a colon or a parenthesis (``"ONNX export"`` names ``ONNX export: the TorchScript exporter``). The pages
  themselves, mkdocs.yml and bench/ cite pages the same way and are held to the same rule.
* Every relative Markdown link to a page (``[text](other.md#anchor)``, ``[text](#anchor)``) of README.md,
  CONTRIBUTING.md and docs/*.md names a page that exists and, where it has one, an anchor of that page.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]
CODE_FOLDERS = ("feast_edge", "server", "device_agent")
OTHER_CITERS = (*PAGES, REPO / "mkdocs.yml", *sorted((REPO / "bench").rglob("*.py")))  # cite pages the same way
GENERATED = {DOCS / "cli.md"}  # written at build time by docs_hooks/cli_reference.py, never committed

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ISSUE = re.compile(r"\bissue\s+#?\d+|#\d+\b", re.IGNORECASE)
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|tmp|root|home)/\S+")
# docs/X.md, then optionally #anchor, §N.M (or a named §, which resolves to nothing) and a quoted section name, the
# name possibly on the next line (a docstring's or a comment's continuation).
REFERENCE = re.compile(
    r"(?<![\w/.-])docs/(?P<page>[\w-]+\.md)"
    r"(?:#(?P<anchor>[\w-]+))?"
    r"(?:[ \t]*§(?P<section>\d+(?:\.\d+)*|[^\W\d]\w*))?"
    r"(?:(?:,[ \t]*|[ \t]+)(?:\n[ \t]*#?[ \t]*)?\(?\"(?P<name>[^\"\n]+)\")?"
)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def headings(markdown: str) -> list[str]:
    """The text of every heading of a page, in order, code blocks left out."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.append(match.group(2))
    return found


def _plain(heading: str) -> str:
    """A heading as it renders: no attribute list, links as their text, no backticks."""
    heading = re.sub(r"\s*\{[^}]*\}\s*$", "", heading)
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return heading.replace("`", "").strip()


def _name(text: str) -> str:
    return " ".join(_plain(text).lower().split())


def slugs(heading_texts: list[str]) -> set[str]:
    """Every anchor the headings get: mkdocs' (Python-Markdown toc: ASCII, runs of hyphens and spaces become one
    hyphen, repeats ``_1``) and GitHub's (Unicode kept, each space one hyphen, repeats ``-1``)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in heading_texts:
        plain = _plain(heading)
        ascii_text = unicodedata.normalize("NFKD", plain).encode("ascii", "ignore").decode("ascii")
        mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower())
        github = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        for slug, separator in ((mkdocs, "_"), (github, "-")):
            count = seen.get(separator + slug, 0)
            seen[separator + slug] = count + 1
            found.add(slug if count == 0 else f"{slug}{separator}{count}")
    return found


def names(heading_texts: list[str]) -> set[str]:
    """The names a quoted reference may use for a heading: its text, or the part before its colon or parenthesis,
    each with or without the section number it starts with (``"Round sequence"`` names ``7. Round sequence``)."""
    found = set()
    for heading in heading_texts:
        for name in (_name(heading), re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", _name(heading))):
            found |= {name, name.split(":", 1)[0].strip(), name.split(" (", 1)[0].strip()}
    return found


def section_exists(section: str, heading_texts: list[str]) -> bool:
    """Whether ``section`` (``7``, ``1.1``) numbers a heading (``7. Round sequence``, ``1.1 The training recipe``)."""
    number = re.compile(rf"{re.escape(section)}\.?(?:\s|$)")
    return any(number.match(_plain(h)) for h in heading_texts)


def anchors(markdown: str) -> set[str]:
    """Every anchor a page has: its headings' slugs, attribute-list ids (``{#id}``) and HTML ids (``<a id="…">``)."""
    ids = re.findall(r"\{[^}]*#([\w-]+)[^}]*\}", markdown) + re.findall(r"<a\s[^>]*\bid=\"([\w-]+)\"", markdown)
    return slugs(headings(markdown)) | set(ids)


def missing_targets(page: Path, anchor: str | None, section: str | None, name: str | None) -> list[str]:
    """What of a reference to ``page`` (its anchor, section, quoted name) the page does not have."""
    if page in GENERATED:
        return []
    if not page.is_file():
        return ["no such page"]
    markdown = page.read_text(encoding="utf-8")
    texts = headings(markdown)
    missing = []
    if anchor and anchor not in anchors(markdown):
        missing.append(f"no anchor #{anchor}")
    if section and not (section[0].isdigit() and section_exists(section, texts)):
        missing.append(f"no section §{section}")  # a named one (§Topics) too: sections are cited by number
    if name and _name(name) not in names(texts):
        missing.append(f'no heading "{name}"')
    return missing


def code_references(text: str) -> list[tuple[int, str, str | None, str | None, str | None]]:
    """(line, page, anchor, section, quoted name) for every ``docs/X.md`` a file's text cites."""
    return [
        (text.count("\n", 0, m.start()) + 1, m["page"], m["anchor"], m["section"], m["name"])
        for m in REFERENCE.finditer(text)
    ]


def broken_code_references(files: list[Path], docs: Path = DOCS, root: Path = REPO) -> list[str]:
    broken = []
    for path in files:
        for line, page, anchor, section, name in code_references(path.read_text(encoding="utf-8")):
            for missing in missing_targets(docs / page, anchor, section, name):
                broken.append(f"{path.relative_to(root).as_posix()}:{line}: docs/{page}: {missing}")
    return broken


def code_files() -> list[Path]:
    return [
        path
        for folder in CODE_FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def _prose(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of a page outside code blocks, inline code blanked (a link there is not a link)."""
    lines, fenced = [], False
    for number, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, re.sub(r"`[^`]*`", "``", line)))
    return lines


def broken_links(page: Path) -> list[str]:
    """``page:line: target: what is missing`` for each relative link to a Markdown page or anchor that fails."""
    broken = []
    for number, line in _prose(page.read_text(encoding="utf-8")):
        for match in LINK.finditer(line):
            target = match["target"]
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            if path and not path.endswith(".md"):
                continue  # an image, a source file: tests/cli/test_docs_options.py checks that it exists
            linked = (page.parent / path).resolve() if path else page
            for missing in missing_targets(linked, anchor or None, None, None):
                broken.append(f"{page.relative_to(REPO).as_posix()}:{number}: {target}: {missing}")
    return broken


def test_the_scanners_read_headings_slugs_and_references() -> None:
    page = "# Top\n## 1. Connection\n```\n## 9. in a code block\n```\n### 1.1 The `[train]` recipe {#recipe}\n"
    page += "## ONNX export: the TorchScript exporter\n## Results\n## Results (measured)\n## Results\n"
    page += "## γ-allocation — what it buys\n"
    texts = headings(page)
    assert texts == [
        "Top", "1. Connection", "1.1 The `[train]` recipe {#recipe}", "ONNX export: the TorchScript exporter",
        "Results", "Results (measured)", "Results", "γ-allocation — what it buys",
    ]  # fmt: skip
    assert {
        "1-connection", "11-the-train-recipe", "recipe", "onnx-export-the-torchscript-exporter", "results",
        "results_1", "results-1", "-allocation-what-it-buys", "γ-allocation--what-it-buys",
    } <= anchors(page)  # fmt: skip
    assert section_exists("1", texts) and section_exists("1.1", texts) and not section_exists("9", texts)
    assert not section_exists("1.2", texts)
    expected = {"connection", "the [train] recipe", "onnx export", "onnx export: the torchscript exporter", "results"}
    assert expected <= names(texts) and "results (measured)" in names(texts)
    code = (
        '# see docs/protocol.md §7 "Round sequence" and docs/benchmarks.md ("Bounded weights")\n'
        '"""(docs/benchmarks.md,\n"Threads on a shared machine"), docs/x.md#an-anchor, docs/y.md §Topics."""\n'
        "help='(docs/privacy.md).' + \"docs/security.md §9.\"\n"
    )
    assert code_references(code) == [
        (1, "protocol.md", None, "7", "Round sequence"),
        (1, "benchmarks.md", None, None, "Bounded weights"),
        (2, "benchmarks.md", None, None, "Threads on a shared machine"),
        (3, "x.md", "an-anchor", None, None),
        (3, "y.md", None, "Topics", None),
        (4, "privacy.md", None, None, None),
        (4, "security.md", None, "9", None),
    ]


def test_a_broken_reference_is_reported_with_its_file_and_line(tmp_path: Path) -> None:
    page = '# Page\n## 1. One\n### 1.2 Sub\n<a id="top"></a>\n## Two words: more\n'
    (tmp_path / "page.md").write_text(page, encoding="utf-8")
    code = tmp_path / "code.py"
    code.write_text(
        '# fine: docs/page.md §1.2, docs/page.md, "Two words", docs/page.md#two-words-more, docs/page.md §1 "1. One"\n'
        '# broken: docs/page.md §2, docs/page.md "Three", docs/page.md#one, docs/none.md, docs/page.md §Two\n'
        '# fine too: docs/page.md "One" (the heading without its number), docs/page.md#top\n',
        encoding="utf-8",
    )
    assert broken_code_references([code], docs=tmp_path, root=tmp_path) == [
        "code.py:2: docs/page.md: no section §2",
        'code.py:2: docs/page.md: no heading "Three"',
        "code.py:2: docs/page.md: no anchor #one",
        "code.py:2: docs/none.md: no such page",
        "code.py:2: docs/page.md: no section §Two",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_heading_names_an_issue(page: Path) -> None:
    wrong = [h for h in headings(page.read_text(encoding="utf-8")) if ISSUE.search(h)]
    assert wrong == [], f"{page.name}: headings named by an issue, not by what they measure or describe: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_page_writes_a_development_machine_path(page: Path) -> None:
    wrong = [
        f"{page.name}:{number}: {match.group(0)}"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        for match in MACHINE_PATH.finditer(line)
    ]
    assert wrong == [], "paths of a development machine (write runs/…, $OUT/… or the file name):\n" + "\n".join(wrong)


def test_every_docs_reference_in_the_code_resolves() -> None:
    files = code_files()
    assert len(files) > 50, f"the scan found only {len(files)} Python files under {CODE_FOLDERS}"
    broken = broken_code_references(files)
    assert broken == [], "references to docs pages, anchors or sections that do not exist:\n" + "\n".join(broken)


def test_every_docs_reference_in_the_pages_and_benchmarks_resolves() -> None:
    broken = broken_code_references(list(OTHER_CITERS))
    assert broken == [], "references to docs pages, anchors or sections that do not exist:\n" + "\n".join(broken)


def test_every_relative_link_between_pages_names_an_existing_page_and_anchor() -> None:
    broken = [entry for page in PAGES for entry in broken_links(page)]
    assert broken == [], "links to pages or anchors that do not exist:\n" + "\n".join(broken)
