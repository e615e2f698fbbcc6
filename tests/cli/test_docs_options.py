"""Every ``feast-edge|feast-server|feast-agent SUBCOMMAND --option`` the README and docs/ write exists, and every
relative link they make resolves inside the repository (issue 38).

The commands' options are read from the Typer apps themselves (click's parameters), so a renamed or removed option
that a page still shows fails here, not on a user's machine. Commands are read from code blocks and inline code:
a command word, its subcommands, then the options up to the next command, a comment (``#``) or the end of the
inline code.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import typer

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"\b(feast-edge|feast-server|feast-agent)((?:[ \t]+[a-z][a-z0-9-]*){0,2})")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")


def _apps() -> dict[str, click.Command]:
    from feast_edge.agent.cli import app as agent
    from feast_edge.cli.main import app as edge
    from feast_edge.server.cli import app as server

    return {name: typer.main.get_command(app) for name, app in (("feast-edge", edge), ("feast-server", server),
                                                                 ("feast-agent", agent))}  # fmt: skip


def _resolve(command: click.Command, words: list[str]) -> tuple[click.Command, int]:
    """The deepest subcommand ``words`` name, and how many of them it took."""
    taken = 0
    for word in words:
        sub = getattr(command, "commands", {}).get(word)
        if sub is None:
            break
        command, taken = sub, taken + 1
    return command, taken


def _options(command: click.Command) -> set[str]:
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts)} | {"--help"}


def _mentions(text: str) -> list[tuple[int, str, list[str], list[str]]]:
    """(line, command word, words after it, options) for every command a page writes."""
    found = []
    lines = re.sub(r"\\\n[ \t]*", " ", text).splitlines()  # a command continued with "\" is one line
    for number, line in enumerate(lines, 1):
        for match in COMMAND.finditer(line):
            rest = line[match.end() :]
            following = COMMAND.search(rest)
            rest = rest[: following.start()] if following else rest
            rest = re.split(r"\s#\s|`|\|", rest)[0]  # a comment, the end of inline code, a table cell
            found.append((number, match.group(1), match.group(2).split(), OPTION.findall(rest)))
    return found


def test_the_scanner_reads_commands_options_and_where_they_end() -> None:
    text = "run `feast-server run --rounds 3` then `feast-agent run --data x`\n" + (
        "feast-edge simulate --method feast \\\n    --rounds 2  # tensorboard --logdir runs\n"
    )
    assert _mentions(text) == [
        (1, "feast-server", ["run"], ["--rounds"]),
        (1, "feast-agent", ["run"], ["--data"]),
        (2, "feast-edge", ["simulate"], ["--method", "--rounds"]),
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_option_a_page_names_exists(page: Path) -> None:
    apps = _apps()
    wrong = []
    for number, word, words, options in _mentions(page.read_text(encoding="utf-8")):
        command, taken = _resolve(apps[word], words)
        if taken == 0:
            continue  # the program named in prose ("start feast-agent with --preset ..."): no command to check
        known = _options(command)
        name = " ".join([word, *words[:taken]])
        wrong += [f"{page.name}:{number}: {name} {option}" for option in options if option not in known]
    assert wrong == [], "options a page names that the command does not have:\n" + "\n".join(wrong)


def test_an_option_a_command_lost_is_caught() -> None:
    # docs/flower.md showed `feast-edge partition ... --per-round 2`, an option partition never had.
    [(_, word, words, options)] = _mentions("feast-edge partition --out parts --clients 2 --per-round 2")
    command, taken = _resolve(_apps()[word], words)
    assert taken == 1 and [o for o in options if o not in _options(command)] == ["--per-round"]


LINK = re.compile(r"\]\(([^)\s]+)\)")
GENERATED = {REPO / "docs" / "cli.md"}  # written at build time by docs_hooks/cli_reference.py, never committed


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_a_page_makes_resolves_inside_the_repository(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not (path.exists() or path in GENERATED) or REPO not in path.parents:
            broken.append(target)
    assert broken == [], f"{page.name}: links to files a clone does not have: {broken}"
