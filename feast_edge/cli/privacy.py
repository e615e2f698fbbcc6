"""The differential-privacy options of ``feast-edge simulate`` and ``feast-server run`` (feast_edge.privacy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import typer

from feast_edge.cli.common import F, option_group

# The help of each --dp-* setting (feast_edge.settings.Privacy), for every command that takes them.
DP_HELP = {
    "dp_clip": "Client-level differential privacy: clip each update of a routed slice to this L2 norm C (with "
    "--dp-noise; docs/privacy.md).",
    "dp_noise": "Noise multiplier z: N(0, z²C²) on every coordinate's sum of clipped updates, divided by the number of "
    "devices routed that coordinate.",
    "dp_delta": "δ of the reported ε; below 1/population (default: 1e-5 or 0.1/population).",
    "dp_epsilon": "Privacy budget: refuse a run whose planned rounds exceed it; stop before a round that would.",
    "dp_seed": "Seed the noise (tests only: default noise comes from the OS, never replayed).",
    "dp_mode": "central (the server adds the noise: trusts the server) or local (each device noises its own clipped "
    "update: trusts nobody, costs accuracy).",
    "dp_clip_quantile": "Adaptive clipping (central DP): start at --dp-clip and move the bound each round toward this "
    "quantile of the update norms, privately (e.g. 0.5; Andrew et al. 2021).",
    "dp_clip_lr": "Adaptive clipping: the geometric step of the bound per round.",
    "dp_clip_count_std": "Adaptive clipping: noise std on the count of unclipped updates (default: a tenth of the "
    "privacy, 1.58 z; the updates' noise grows so ε stays that of --dp-noise).",
}
_TYPES = {"dp_seed": (Optional[int], None), "dp_mode": (str, "central"), "dp_clip_lr": (float, 0.2)}


def dp_options() -> Callable[[F], F]:
    """Give a command the ``--dp-*`` options; it receives them as ``dp: dict`` of config keywords (``dp_clip``, ...)."""
    options = {
        key: (*_TYPES.get(key, (Optional[float], None)), typer.Option(f"--{key.replace('_', '-')}", help=text))
        for key, text in DP_HELP.items()
    }
    return option_group("dp", options, dict)
