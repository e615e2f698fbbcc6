"""The server-optimizer options of ``feast-edge demo`` (feast_edge.aggregate.server_opt; their help is the settings'
declaration, feast_edge.settings.Aggregation), and how ``--server-betas`` is read (also by ``simulate`` and ``run``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import typer

from feast_edge.cli.common import F, option_group
from feast_edge.errors import FeastError
from feast_edge.settings import Aggregation
from feast_edge.settings.nested import help_of


def betas(text: str) -> tuple[float, ...]:
    """``--server-betas`` as its two numbers; a FeastError naming the option otherwise."""
    from feast_edge.aggregate.server_opt import parse_betas

    try:
        return parse_betas(text)
    except ValueError as exc:
        raise FeastError(str(exc)) from None


def server_opt_options(default: str = "avg") -> Callable[[F], F]:
    """Give a command the server-optimizer options (``default``: its --server-opt); it receives them as
    ``server_opt: dict`` of config keywords."""
    kinds = {
        "server_opt": (str, default),
        "server_lr": (Optional[float], None),
        "server_momentum": (float, 0.9),
        "server_betas": (str, "0.9,0.99"),
        "server_tau": (float, 1e-3),
    }
    helps = help_of(Aggregation, "server")
    options = {key: (*kind, typer.Option(f"--{key.replace('_', '-')}", help=helps[key])) for key, kind in kinds.items()}

    def build(values: dict[str, Any]) -> dict[str, Any]:
        return {**values, "server_betas": betas(values["server_betas"])}

    return option_group("server_opt", options, build)
