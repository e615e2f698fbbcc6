"""The documentation site (issue 38): ``mkdocs build --strict`` passes, the generated command-line reference names
every command and option of the three console scripts, every page is in the nav and on the landing page, and the
protocol page lists every message kind with its fields.

mkdocs and mkdocs-material are dev dependencies (pyproject.toml): without them these tests fail, they never skip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import typer
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
HOOK = REPO / "docs_hooks" / "cli_reference.py"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _hook() -> ModuleType:
    """The MkDocs hook module, loaded from its file as MkDocs loads it."""
    spec = importlib.util.spec_from_file_location("cli_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _commands(command: click.Command, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``command`` (itself included), read from click's tree independently of the hook."""
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            found += _commands(sub, (*path, name))
    return found


def _sections(markdown: str) -> dict[str, str]:
    """Heading text -> the Markdown under it, up to the next heading."""
    sections: dict[str, str] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            sections[heading] = ""
        else:
            sections[heading] = sections.get(heading, "") + line + "\n"
    return sections


def _names(param: click.Parameter) -> list[str]:
    if isinstance(param, click.Argument):
        return [param.human_readable_name]
    return [*param.opts, *param.secondary_opts]


def test_the_site_builds_strictly_without_a_warning(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=240)
    output = ANSI.sub("", result.stdout + result.stderr)
    warnings = [line for line in output.splitlines() if re.match(r"(WARNING|ERROR)\b", line)]
    assert result.returncode == 0 and warnings == [], f"mkdocs build --strict failed:\n{output}"
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert "feast-server run" in cli and "--broker" in cli  # the hook rendered the generated page


def test_the_validation_settings_fail_a_broken_anchor_a_link_out_of_docs_and_an_unlisted_page(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a](other.md#nowhere) [b](../README.md)\n", encoding="utf-8")
    (docs / "other.md").write_text("# Other\n", encoding="utf-8")
    config = {"site_name": "t", "validation": _config()["validation"], "nav": ["index.md"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    warnings = "\n".join(line for line in result.stderr.splitlines() if line.startswith("WARNING"))
    assert result.returncode != 0
    assert "anchor '#nowhere'" in warnings and "link '../README.md'" in warnings
    assert 'not included in the "nav"' in warnings


def test_the_cli_reference_names_every_command_and_option() -> None:
    hook = _hook()
    programs = hook.load_programs()
    sections = _sections(hook.render_cli_reference(programs))
    missing = []
    for name, root in programs:
        for path, command in _commands(root, (name,)):
            title = " ".join(path)
            if title not in sections:
                missing.append(f"{title} (no section)")
                continue
            for param in command.params:
                if not getattr(param, "hidden", False):
                    missing += [f"{title} {n}" for n in _names(param) if f"`{n}`" not in sections[title]]
    assert missing == [], "the generated reference lacks:\n" + "\n".join(missing)


def test_the_cli_reference_covers_every_console_script() -> None:
    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    documented = {name: target.split(":")[0] for name, target in _hook().PROGRAMS}
    assert documented == {name: target.split(":")[0] for name, target in scripts.items()}


def test_the_renderer_writes_usage_help_and_a_row_per_option() -> None:
    app = typer.Typer()
    group = typer.Typer(help="Things with | pipes and *stars*.")
    app.add_typer(group, name="thing")

    @group.command()
    def make(
        out: Path = typer.Argument(..., help="Where it goes."),
        level: int = typer.Option(3, min=1, max=9, help="How much."),
        mode: str = typer.Option("fast", click_type=click.Choice(["fast", "slow"]), help="Speed."),
        tag: list[str] = typer.Option([], help="Repeatable tag."),
        check: bool = typer.Option(True, help="Check it."),
        secret: str = typer.Option(None, envvar="THING_SECRET", help="A secret."),
        internal: int = typer.Option(0, hidden=True),
    ) -> None:
        """Make one thing."""

    @app.command()
    def other() -> None:
        """Another command."""

    markdown = _hook().render_cli_reference([("prog", typer.main.get_command(app))])
    sections = _sections(markdown)
    assert list(sections)[1:] == ["prog", "prog other", "prog thing", "prog thing make"]  # --help's order
    assert "[`make`](#prog-thing-make)" in sections["prog thing"]
    assert "Things with \\| pipes and \\*stars\\*." in sections["prog thing"]  # escaped: no table cell, no emphasis
    make_section = sections["prog thing make"]
    assert "Usage: prog thing make [OPTIONS] OUT" in make_section and "Make one thing." in make_section
    rows = {line.split("|")[1].strip(): line for line in make_section.splitlines() if line.startswith("| `")}
    assert list(rows) == ["`OUT`", "`--level`", "`--mode`", "`--tag`", "`--check` / `--no-check`", "`--secret`"]
    assert "| path | required | Where it goes. |" in rows["`OUT`"]
    assert "| integer in \\[1, 9\\] | `3` |" in rows["`--level`"]
    assert "| one of fast, slow | `fast` |" in rows["`--mode`"]
    assert "repeatable" in rows["`--tag`"] and "| `--check` |" in rows["`--check` / `--no-check`"]
    assert "(environment variable THING\\_SECRET)" in rows["`--secret`"]


def test_every_docs_page_is_in_the_nav_and_on_the_landing_page() -> None:
    nav = _nav_pages(_config()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert [p for p in pages if p not in nav] == [], "pages missing from mkdocs.yml's nav"
    assert len(nav) == len(set(nav)), "a page is twice in the nav"
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([^)#\s]+\.md)", index))
    assert [p for p in nav if p != "index.md" and p not in linked] == [], "nav pages docs/index.md does not list"
    generated = _hook().PAGE
    assert generated in nav and not (DOCS / generated).exists(), "cli.md is generated, never committed"


def test_the_protocol_page_lists_every_message_kind_with_its_fields() -> None:
    import feast_edge.protocol  # noqa: F401  (registers the round kinds)
    from feast_edge.transport import messages

    text = (DOCS / "protocol.md").read_text(encoding="utf-8")
    common = {name for name in messages._COMMON}
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    missing = []
    for kind in messages.known_kinds():
        fields = [f.name for f in dataclasses.fields(messages._KINDS[kind]) if f.name not in common]
        if not any(row.startswith(f"| `{kind}` |") and all(f"`{f}`" in row for f in fields) for row in rows):
            missing.append(f"{kind}: {', '.join(fields)}")
    assert "round" in messages.known_kinds() and missing == [], "docs/protocol.md lacks a row for:\n" + "\n".join(
        missing
    )
    assert all(f"| `{name}` |" in text for name in common)
