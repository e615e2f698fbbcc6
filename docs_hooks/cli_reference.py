"""MkDocs hook: the command-line reference page (``cli.md``), rendered at build time from the Typer apps themselves.

``mkdocs.yml`` names this module under ``hooks:``. ``on_files`` adds ``cli.md`` as a generated page (MkDocs >= 1.6
``File.generated``), so the reference is never committed and cannot drift from the code: every command and
subcommand of the three console scripts, with its usage line, its help and a table of its arguments and options,
read from click's parameters (what ``--help`` prints). ``render_cli_reference`` is a pure function a test can call.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import click
import typer

PAGE = "cli.md"
# Console script -> its Typer app (pyproject.toml [project.scripts] points at ``main`` in the same module).
PROGRAMS = (
    ("feast-edge", "feast_edge.cli.main:app"),
    ("feast-server", "feast_edge.server.cli:app"),
    ("feast-agent", "feast_edge.agent.cli:app"),
)
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|])")


def load_programs() -> list[tuple[str, click.Command]]:
    """(console script, its click command) for every program in ``PROGRAMS``."""
    programs = []
    for name, target in PROGRAMS:
        module, attribute = target.split(":")
        app = getattr(importlib.import_module(module), attribute)
        programs.append((name, typer.main.get_command(app)))
    return programs


def walk(command: click.Command, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """(command path, command) for ``command`` and every visible subcommand below it, depth first, in help order."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            if not sub.hidden:
                yield from walk(sub, (*path, name))


def visible_params(command: click.Command) -> list[click.Parameter]:
    """The arguments, then the options, that ``--help`` shows (hidden options left out)."""
    params = [p for p in command.params if not getattr(p, "hidden", False)]
    return sorted(params, key=lambda p: not isinstance(p, click.Argument))


def render_cli_reference(programs: Sequence[tuple[str, click.Command]]) -> str:
    """The Markdown of the command-line reference for ``programs`` ((console script, click command) pairs)."""
    lines = [
        "# Command-line reference",
        "",
        "Every command of the three console scripts, generated from the programs themselves when the site is",
        "built: the same usage, help and options as `--help` prints. `feast-edge` runs simulations and builds",
        "presets and caches on one machine, `feast-server` runs a federation over MQTT, `feast-agent` runs on a",
        "device. Every command also takes `--help`.",
        "",
    ]
    for name, root in programs:
        for path, command in walk(root, (name,)):
            lines += _render_command(path, command)
    return "\n".join(lines).rstrip() + "\n"


def _render_command(path: tuple[str, ...], command: click.Command) -> list[str]:
    lines = ["#" * (len(path) + 1) + " " + " ".join(path), ""]
    lines += ["```text", _usage(path, command), "```", ""]
    if command.help:
        lines += [_text(command.help), ""]
    if isinstance(command, click.Group):
        visible = [(n, c) for n, c in command.commands.items() if not c.hidden]
        lines += ["| command | what it does |", "|---|---|"]
        lines += [f"| [`{n}`](#{_anchor((*path, n))}) | {_cell(c.get_short_help_str(limit=200))} |" for n, c in visible]
        lines.append("")
    params = visible_params(command)
    if params:
        lines += ["| argument or option | type | default | description |", "|---|---|---|---|"]
        lines += [_param_row(p) for p in params]
        lines.append("")
    return lines


def _usage(path: tuple[str, ...], command: click.Command) -> str:
    context = click.Context(command, info_name=" ".join(path))
    return " ".join(["Usage:", *path, *command.collect_usage_pieces(context)])


def _anchor(path: tuple[str, ...]) -> str:
    """The id MkDocs' toc extension gives the heading ``" ".join(path)`` (lower case, spaces become hyphens)."""
    return "-".join(path).lower()


def _param_row(param: click.Parameter) -> str:
    if isinstance(param, click.Argument):
        names = f"`{param.human_readable_name}`"
    else:
        names = ", ".join(f"`{name}`" for name in param.opts)
        if param.secondary_opts:
            names += " / " + ", ".join(f"`{name}`" for name in param.secondary_opts)
    help_text = getattr(param, "help", None) or ""
    envvar = param.envvar if isinstance(param.envvar, str) else ", ".join(param.envvar or ())
    if envvar:
        help_text += f" (environment variable {envvar})"
    return f"| {names} | {_cell(_type(param))} | {_default(param)} | {_cell(help_text)} |"


def _type(param: click.Parameter) -> str:
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        text = "flag"
    elif isinstance(kind, click.Choice):
        text = "one of " + ", ".join(str(c) for c in kind.choices)
    elif isinstance(kind, (click.IntRange, click.FloatRange)):
        text = kind.name.removesuffix(" range") + " " + _bounds(kind)
    else:
        text = kind.name
    return text + (", repeatable" if param.multiple else "")


def _bounds(kind: click.IntRange | click.FloatRange) -> str:
    """``≥ 1``, ``< 10``, ``in [0, 1)``: the range a number option accepts."""
    if kind.min is not None and kind.max is not None:
        return f"in {'(' if kind.min_open else '['}{kind.min}, {kind.max}{')' if kind.max_open else ']'}"
    if kind.min is not None:
        return f"{'>' if kind.min_open else '≥'} {kind.min}"
    return f"{'<' if kind.max_open else '≤'} {kind.max}"


def _default(param: click.Parameter) -> str:
    if param.required:
        return "required"
    if getattr(param, "show_default", None) is False or callable(param.default):
        return ""
    value: Any = param.default
    if value is None or value == () or value == []:
        return ""
    if isinstance(param, click.Option) and param.is_flag:
        if param.secondary_opts:
            return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        value = ", ".join(str(v) for v in value)
    return f"`{str(value).replace('|', '/')}`"


def _text(help_text: str) -> str:
    """A help text as Markdown paragraphs: click's no-rewrap markers dropped, Markdown's special characters escaped."""
    paragraphs = [p.replace("\b\n", "").strip() for p in help_text.split("\n\n")]
    return "\n\n".join(_MARKDOWN_SPECIAL.sub(r"\\\1", p) for p in paragraphs if p)


def _cell(text: str) -> str:
    return " ".join(_text(text).split())


def on_files(files: Any, config: Any) -> Any:
    """MkDocs event: add the generated ``cli.md`` to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render_cli_reference(load_programs())))
    return files
