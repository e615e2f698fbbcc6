"""The commands whose options come from a run's settings, as click sees them: every parameter's names, type, default,
bounds and panel (everything ``--help`` shows but the help text), to compare before and after a change to how the
options are built.

    python tests/cli_parameters.py record   # write tests/data/cli-parameters.json from the code as it is
    python tests/cli_parameters.py show     # print the same JSON

tests/cli/test_settings_options.py checks that the code still gives the recorded parameters: no option renamed, no
default or bound changed, none moved to another panel, unless the file is recorded again with the change.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import typer

RECORDED = Path(__file__).resolve().parent / "data" / "cli-parameters.json"
# (console script, command path): the commands that take settings as options (simulate and run: every setting;
# partition: the population's; demo: the server optimizer's; export: the serving's).
COMMANDS = (
    ("feast-edge", ("simulate",)),
    ("feast-edge", ("partition",)),
    ("feast-edge", ("demo",)),
    ("feast-server", ("run",)),
    ("feast-server", ("export",)),
)


def _app(script: str) -> typer.Typer:
    if script == "feast-edge":
        from feast_edge.cli.main import app
    else:
        from feast_edge.server.cli import app
    return app


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (a path, an enum or another object as its text)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def parameter(param: click.Parameter) -> dict[str, Any]:
    """What click knows of ``param``, its help left out."""
    kind = param.type
    return {
        "name": param.name,
        "kind": type(param).__name__,
        "opts": list(param.opts),
        "secondary_opts": list(param.secondary_opts),
        "type": kind.name,
        "default": _plain(param.default),
        "required": param.required,
        "is_flag": getattr(param, "is_flag", False),
        "multiple": param.multiple,
        "nargs": param.nargs,
        "min": _plain(getattr(kind, "min", None)),
        "max": _plain(getattr(kind, "max", None)),
        "min_open": getattr(kind, "min_open", None),
        "max_open": getattr(kind, "max_open", None),
        "envvar": _plain(param.envvar),
        "hidden": getattr(param, "hidden", False),
        "rich_help_panel": getattr(param, "rich_help_panel", None),
    }


def parameters() -> dict[str, list[dict[str, Any]]]:
    """Every parameter of every command in ``COMMANDS``, by name (their order in ``--help`` follows the settings'
    declarations), by ``"script command"``."""
    dump = {}
    for script, path in COMMANDS:
        command = typer.main.get_command(_app(script))
        for name in path:
            command = command.commands[name]  # type: ignore[attr-defined]
        dump[" ".join((script, *path))] = sorted((parameter(p) for p in command.params), key=lambda p: p["name"])
    return dump


def recorded() -> dict[str, list[dict[str, Any]]]:
    """The parameters as last recorded."""
    return json.loads(RECORDED.read_text(encoding="utf-8"))


def _text() -> str:
    """The JSON of :func:`parameters`, one parameter a line (a change shows as the lines of the parameters it moved)."""
    commands = [
        f"{json.dumps(name)}: [\n" + ",\n".join(f"  {json.dumps(p, ensure_ascii=False)}" for p in params) + "\n ]"
        for name, params in parameters().items()
    ]
    return "{\n " + ",\n ".join(commands) + "\n}\n"


if __name__ == "__main__":
    action = sys.argv[1] if len(sys.argv) > 1 else "show"
    if action == "record":
        RECORDED.write_text(_text(), encoding="utf-8")
        print(f"recorded {RECORDED}")
    elif action == "show":
        print(_text(), end="")
    else:
        sys.exit(f"usage: {sys.argv[0]} record|show")
