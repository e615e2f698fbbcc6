"""``feast-edge flower new DIR``: a Flower App project that runs FEAST with Flower's own tools (docs/flower.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from feast_edge.cli.common import PresetOpt, make_app, make_console

console = make_console()
flower_app = make_app("flower", "FEAST on Flower: a Flower App project whose ServerApp and ClientApp are feast-edge's.")


def register(app: typer.Typer) -> None:
    """Add ``flower`` to the ``feast-edge`` app."""
    app.add_typer(flower_app, name="flower")


@flower_app.command("new")
def new(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write the project (created if missing).")],
    preset: PresetOpt = "fmnist-small",
    rounds: Annotated[int, typer.Option("--rounds", help="Rounds (run config 'rounds').")] = 10,
    per_round: Annotated[int, typer.Option("--per-round", help="Devices per round (run config 'per-round').")] = 2,
    data: Annotated[
        str, typer.Option("--data", help="The server's own validation data for the run config (default: none).")
    ] = "",
    force: Annotated[bool, typer.Option("--force", help="Overwrite the project's files if they exist.")] = False,
) -> None:
    """Write pyproject.toml ([tool.flwr.app] naming feast-edge's ServerApp and ClientApp), README.md and .gitignore."""
    from feast_edge.flower import require_flwr
    from feast_edge.flower.template import write_template

    require_flwr()
    written = write_template(directory, preset=preset, rounds=rounds, per_round=per_round, data=data, force=force)
    for path in written:
        console.print(f"wrote {path}")
    console.print(f"next: start a SuperLink and SuperNodes, then [bold]flwr run {directory} <superlink>[/] (README.md)")
