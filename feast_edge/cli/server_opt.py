"""The server-optimizer options of ``feast-edge simulate`` and ``feast-server run`` (feast_edge.aggregate.server_opt)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import typer

from feast_edge.cli.common import F, option_group
from feast_edge.errors import FeastError


def server_opt_help() -> dict[str, str]:
    """The help of each --server-* setting (feast_edge.settings.Aggregation), for every command that takes them."""
    from feast_edge.aggregate.server_opt import DEFAULT_LR

    lrs = ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())
    return {
        "server_opt": "The server's step from each round's sparse aggregate: avg (method §6), momentum (FedAvgM), adam "
        "(FedAdam) or yogi (FedYogi); routed positions only.",
        "server_lr": f"Server learning rate (default: {lrs}).",
        "server_momentum": "momentum: its coefficient, in [0, 1).",
        "server_betas": "adam/yogi: β₁,β₂ of the first and second moments, each in [0, 1).",
        "server_tau": "adam/yogi: adaptivity τ (> 0).",
    }


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
    options = {
        key: (*kinds[key], typer.Option(f"--{key.replace('_', '-')}", help=text))
        for key, text in server_opt_help().items()
    }

    def build(values: dict[str, Any]) -> dict[str, Any]:
        return {**values, "server_betas": betas(values["server_betas"])}

    return option_group("server_opt", options, build)
