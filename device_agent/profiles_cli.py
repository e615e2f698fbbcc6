"""``feast-agent profiles``: the device profiles ``--profile`` accepts, built-in and on ``$FEAST_EDGE_PROFILE_PATH``."""

from __future__ import annotations

from typing import Annotated

import typer

from feast_edge.cli import common

console = common.make_console()


def profiles_command(
    preset: Annotated[str | None, typer.Option("--preset", "-p", help="Only profiles derived for this preset.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per profile, one per line.")] = False,
) -> None:
    """List the device profiles --profile accepts: built-in ones and those on $FEAST_EDGE_PROFILE_PATH."""
    import json

    from rich.table import Table

    from feast_edge.budget.profile import available_profiles, builtin_dir, load_profile

    found = [(load_profile(path), path) for path in available_profiles().values()]
    found = [(p, path) for p, path in found if preset is None or p.preset == preset]
    if as_json:
        for p, path in found:
            typer.echo(
                json.dumps(
                    {
                        "name": p.name,
                        "preset": p.preset,
                        "device": p.device,
                        "budget_macs": p.budget_macs,
                        "file": str(path),
                    }
                )
            )
        return
    table = Table(title="device profiles (feast-agent run --profile NAME)")
    for col in ("profile", "preset", "budget", "latency target", "kind", "description", "source"):
        table.add_column(col, justify="right" if col in ("budget", "latency target") else "left", overflow="fold")
    builtin = builtin_dir().resolve()
    for p, path in found:
        where = "built-in" if path.resolve().parent == builtin else str(path)
        table.add_row(
            p.name,
            p.preset,
            f"{p.budget_macs / 1e6:.2f}M MACs",
            f"{p.latency_target_ms:g} ms",
            "measured" if p.measurements else "documented",
            p.description,
            where,
        )
    console.print(table)
