"""The server-optimizer options of ``feast-edge simulate`` and ``feast-server run`` (feast_edge.aggregate.server_opt)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import typer

from feast_edge.cli.common import F, option_group
from feast_edge.errors import FeastError


def server_opt_options(default: str = "avg") -> Callable[[F], F]:
    """Give a command the server-optimizer options (``default``: its --server-opt); it receives them as
    ``server_opt: dict`` of config keywords."""
    from feast_edge.aggregate.server_opt import DEFAULT_LR

    lrs = ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())
    options = {
        "server_opt": (
            str,
            default,
            typer.Option(
                "--server-opt",
                help="The server's step from each round's sparse aggregate: avg (method §6), momentum (FedAvgM), adam "
                "(FedAdam) or yogi (FedYogi); routed positions only.",
            ),
        ),
        "server_lr": (
            Optional[float],
            None,
            typer.Option("--server-lr", help=f"Server learning rate (default: {lrs})."),
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

    return option_group("server_opt", options, build)
