"""The server-optimizer options of ``feast-edge simulate`` and ``feast-server run`` (feast_edge.aggregate.server_opt)."""

from __future__ import annotations

from typing import Any, Optional

import typer

from feast_edge.cli.common import F, option_group
from feast_edge.errors import FeastError


def server_opt_options(func: F) -> F:
    """Give a command the server-optimizer options; it receives them as ``server_opt: dict`` of config keywords."""
    options = {
        "server_opt": (
            str,
            "avg",
            typer.Option(
                "--server-opt",
                help="The server's step from each round's sparse aggregate: avg (SPEC §6), momentum (FedAvgM), adam "
                "(FedAdam) or yogi (FedYogi); routed positions only.",
            ),
        ),
        "server_lr": (
            Optional[float],
            None,
            typer.Option("--server-lr", help="Server learning rate (default: avg/momentum 1, adam/yogi 0.01)."),
        ),
        "server_momentum": (
            float,
            0.9,
            typer.Option("--server-momentum", help="momentum: its coefficient, in [0, 1)."),
        ),
        "server_betas": (
            str,
            "0.9,0.99",
            typer.Option("--server-betas", help="adam/yogi: β₁,β₂ of the first and second moments, each in [0, 1)."),
        ),
        "server_tau": (float, 1e-3, typer.Option("--server-tau", help="adam/yogi: adaptivity τ (> 0).")),
    }

    def build(values: dict[str, Any]) -> dict[str, Any]:
        from feast_edge.aggregate.server_opt import parse_betas

        try:
            values["server_betas"] = parse_betas(values["server_betas"])
        except ValueError as exc:
            raise FeastError(str(exc)) from None
        return values

    return option_group("server_opt", options, build)(func)
