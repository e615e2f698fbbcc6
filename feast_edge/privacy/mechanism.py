"""The Gaussian mechanism on FEAST's sparse sum: clip each update, noise each coordinate's sum, divide by a public count.

A cohort member ``i`` returns the leading slices it was routed (method §5). Under DP its update is

    Δ_i = clip(θ'_i − θ_t, C)        over its routed *parameters*; BN statistics and counters are not sent
                                     (they are set back to the routed global values: they would leak unclipped)

and every global coordinate ``u`` that ``n_u ≥ 1`` cohort members were routed becomes

    θ_{t+1}[u] = θ_t[u] + (Σ_{i: u∈U_i} Δ_i[u] + N(0, z²C²)) / n_u

``n_u`` comes from the plans (which slices were routed), not from the data, so dividing by it is post-processing.
Every coordinate's sum gets the noise its sensitivity needs: replacing one device's data moves the vector of sums by
at most 2C in L2 (the accountant is told so), whichever coordinates it was routed. Dividing the noise of one
average by the whole cohort instead (as a dense FedAvg does) gives a coordinate with ``n_u`` contributors
``m/n_u`` times too little noise. Coordinates nobody was routed keep θ_t and get no noise: no data touched them.

The sample-weighted mean becomes the uniform one (``n_i = 1``): a self-reported sample count would itself leak and
would break the 2C bound. This module is the arithmetic; :mod:`feast_edge.privacy.accountant` turns it into ε.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch

from feast_edge.aggregate.robust import clip_updates, update_norm
from feast_edge.util.slicing import leading_index, leading_slice

StateDict = Mapping[str, torch.Tensor]


def private_update(
    global_state: StateDict, state: StateDict, params: Collection[str], clip: float
) -> tuple[dict, float]:
    """``state`` as DP aggregates it, and the L2 norm of its parameters' change before clipping.

    Tensors that are not parameters (BN running statistics, batch counters) go back to the routed global values; the
    parameters' change is scaled to L2 norm ``clip`` when it is longer (exactly ``θ + Δ·C/‖Δ‖``)."""
    frozen = {
        name: x if name in params else leading_slice(global_state[name].detach(), x.shape).clone()
        for name, x in state.items()
    }
    norm = update_norm(frozen, global_state)
    [(clipped, _)] = clip_updates(global_state, [(frozen, 1)], clip)
    return dict(clipped), norm


def routed_counts(
    global_state: StateDict, states: Sequence[StateDict], names: Collection[str]
) -> dict[str, torch.Tensor]:
    """Per tensor of ``names``: how many of ``states`` cover each global position (their leading slices)."""
    counts = {}
    for name in names:
        count = torch.zeros(global_state[name].shape, dtype=torch.float64)
        for state in states:
            if name in state:
                count[leading_index(state[name].shape)] += 1
        counts[name] = count
    return counts


UPDATES, COUNT = 0xD1, 0xC7  # the two noise streams of a round: the coordinates' sums, the unclipped count


def noise_generator(seed: int | None, t: int, stream: int = UPDATES) -> torch.Generator:
    """Round ``t``'s noise generator: from ``seed`` and ``t`` (reproducible, tests) or from the OS (every other run)."""
    if seed is None:
        start = secrets.randbits(63)
    else:
        start = int(np.random.SeedSequence([seed, t, stream]).generate_state(1, np.uint64)[0] >> np.uint64(1))
    return torch.Generator().manual_seed(start)


def add_sum_noise(
    global_state: StateDict, counts: Mapping[str, torch.Tensor], std: float, generator: torch.Generator
) -> None:
    """Add N(0, std²)/n_u in place to every position of ``counts``' tensors that ``n_u ≥ 1`` updates covered.

    ``global_state`` already holds the uniform mean of the clipped updates there, so this is the noise of the sum
    ``N(0, std²)`` divided by the public count, as the module docstring says."""
    with torch.no_grad():
        for name, count in counts.items():
            target = global_state[name]
            draw = torch.randn(count.shape, generator=generator, dtype=torch.float64)
            scale = torch.where(count > 0, std / count.clamp(min=1), torch.zeros_like(count))
            target.add_((draw * scale).to(target.dtype))


def noised_update(
    global_state: StateDict, state: StateDict, params: Collection[str], std: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Local DP: ``state`` (already clipped) with N(0, std²) added to each routed parameter before it leaves the client."""
    out = dict(state)
    with torch.no_grad():
        for name in sorted(
            set(params) & state.keys()
        ):  # by name: a set's or a state's order may differ between processes
            x = state[name]
            out[name] = x + (torch.randn(x.shape, generator=generator, dtype=torch.float64) * std).to(x.dtype)
    return out


def noised_unclipped(norms: Sequence[float], clip: float, std: float, generator: torch.Generator) -> float:
    """Adaptive clipping's private statistic: the fraction of ``norms`` within ``clip``, from ``Σ(b_i − ½) + N(0, std²)``.

    Centring the bits halves the count's sensitivity (one client moves it by at most ½ added or removed, 1 replaced);
    the cohort size is public. Andrew, Thakkar, McMahan, Ramaswamy 2021, Algorithm 1."""
    centred = sum((1.0 if n <= clip else 0.0) - 0.5 for n in norms)
    draw = float(torch.randn((), generator=generator, dtype=torch.float64))
    return (centred + std * draw) / max(1, len(norms)) + 0.5


def next_clip(clip: float, unclipped: float, quantile: float, lr: float) -> float:
    """The next round's bound: ``C·exp(−lr·(b̃ − γ))``, smaller when more than the quantile ``γ`` went unclipped."""
    return clip * math.exp(-lr * (unclipped - quantile))


def client_seed(seed: int, client: str) -> int:
    """The seed of ``client``'s own local-DP noise in a seeded run (the device agent draws the same)."""
    return int(np.random.SeedSequence([seed, *client.encode()]).generate_state(1)[0])
