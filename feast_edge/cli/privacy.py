"""The help of the differential-privacy options of ``feast-edge simulate`` and ``feast-server run``
(feast_edge.privacy; the options themselves are built from the settings: feast_edge.cli.panels)."""

from __future__ import annotations

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
