"""Every ``method §N`` the code and docs cite is a section of docs/method.md, and nothing points outside the repository.

Code and docs cite the method reference as ``method §N`` (``## N.`` in docs/method.md), ``method §N.M``
(``### N.M``), ranges ``method §N-§M`` / ``method §N–§M`` and lists ``method §N, §M`` / ``method §N/§M``; every
section named, both ends of a range included, must exist as a heading. The specification the method was first
written against lived in a folder beside the repository, which a clone never has: no file may cite it or point
there any more.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
METHOD = REPO / "docs" / "method.md"
TOP_FILES = ("README.md", "CONTRIBUTING.md")
FOLDERS = ("docs", "feast_edge", "server", "device_agent", "bench", "tests")
SUFFIXES = (".py", ".md", ".toml")
SECTION = r"§\d+(?:\.\d+)?"
# "method §4", "method §7's", "method §1-§4", "method §5–§8", "method §4, §8", "method §6/§9", "method §3.1"
CITATION = re.compile(rf"\bmethod ({SECTION}(?:\s*(?:[-–/,]|and|or)\s*{SECTION})*)")
HEADING = re.compile(r"^(?:## (\d+)\.|### (\d+\.\d+)) ")
SELF = Path(__file__).resolve()
# The old citation form and the old folder, built from parts so that this file does not write them itself.
OUTSIDE = ("SP" + "EC" + " §", ".." + "/shared")


def scanned_files() -> list[Path]:
    """The README, CONTRIBUTING and every Python, Markdown and TOML file of the scanned folders (no .venv, caches),
    except this file, whose examples cite missing sections on purpose."""
    files = [REPO / name for name in TOP_FILES if (REPO / name).is_file()]
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            parts = path.relative_to(REPO).parts
            if (
                path.suffix in SUFFIXES
                and path.is_file()
                and not any(p.startswith(".") or p == "__pycache__" for p in parts)
                and path.resolve() != SELF
            ):
                files.append(path)
    return files


def citations(text: str) -> list[tuple[int, str]]:
    """``(line, section)`` for each section a ``method §…`` citation in ``text`` names: ``(3, "7")``, ``(9, "3.1")``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in CITATION.finditer(line):
            found += [(number, section) for section in re.findall(r"§(\d+(?:\.\d+)?)", match.group(1))]
    return found


def sections(text: str) -> set[str]:
    """The sections a method page defines: ``N`` for ``## N.``, ``N.M`` for ``### N.M`` (not inside code blocks)."""
    found, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.add(match.group(1) or match.group(2))
    return found


def missing_citations(files: list[Path], defined: set[str], root: Path = REPO) -> list[str]:
    """``file:line: method §N`` (``file`` relative to ``root``) for each citation of a section not in ``defined``."""
    wrong = []
    for path in files:
        for number, section in citations(path.read_text(encoding="utf-8", errors="replace")):
            if section not in defined:
                wrong.append(f"{path.relative_to(root).as_posix()}:{number}: method §{section}")
    return wrong


def test_the_scanner_reads_every_citation_form() -> None:
    text = (
        "see method §7's loss (method §4, §8)\n"
        "ranges: method §1-§4 and method §5–§8; lists: method §6/§9\n"
        "a subsection: method §3.1. Not a citation: docs/protocol.md §7, the paper's §2\n"
    )
    assert citations(text) == [(1, "7"), (1, "4"), (1, "8"), (2, "1"), (2, "4"), (2, "5"), (2, "8"), (2, "6"),
                               (2, "9"), (3, "3.1")]  # fmt: skip
    page = "# Title\n## 1. One\n### 1.2 Sub\n```\n## 9. in a code block\n```\n## 10. Ten\n"
    assert sections(page) == {"1", "1.2", "10"}


def test_a_citation_of_a_missing_section_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("fine: method §2, §3\nbroken: method §2-§12 and method §3.4\n", encoding="utf-8")
    assert missing_citations([page], {"2", "3"}, tmp_path) == ["page.md:2: method §12", "page.md:2: method §3.4"]


def test_the_method_page_numbers_its_sections_one_to_ten_and_on() -> None:
    top = sorted(int(s) for s in sections(METHOD.read_text(encoding="utf-8")) if "." not in s)
    assert top[:10] == list(range(1, 11)) and top == list(range(1, len(top) + 1)), top


def test_every_cited_section_exists_in_the_method_page() -> None:
    defined = sections(METHOD.read_text(encoding="utf-8"))
    wrong = missing_citations(scanned_files(), defined)
    assert wrong == [], "citations of sections docs/method.md does not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize("needle", OUTSIDE)
def test_no_file_points_outside_the_repository(needle: str) -> None:
    wrong = []
    for path in scanned_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if needle in line:
                wrong.append(f"{path.relative_to(REPO).as_posix()}:{number}: {line.strip()[:100]}")
    assert wrong == [], f"files that name {needle!r} (a clone has no such file; cite docs/method.md):\n" + "\n".join(
        wrong
    )
