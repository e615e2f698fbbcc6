"""ε of a run from Google's ``dp-accounting`` (RDP): fixed-size cohorts drawn without replacement, client level.

Why this accountant: a round draws a cohort of exactly ``m`` of the ``N`` clients available, without replacement
(``feast_edge.run.cohort``), which is not the Poisson sampling most DP-SGD accountants (Opacus's included) assume.
``dp-accounting``'s RDP accountant has the matching event, ``SampledWithoutReplacementDpEvent`` (Wang, Balle,
Kasiviswanathan 2019, Theorem 27), under the *replace-one* neighbouring relation that fixed-size sampling needs: two
federations differ in one client's data, the population size is public. Replacing one client's clipped update moves
the noised sum by at most 2C, so the Gaussian's noise multiplier relative to that sensitivity is ``z/2``.

* central DP: one subsampled Gaussian event per round, ``q = m/N`` of that round (the population a round draws from
  may change in a deployment: each round is accounted with its own ``N`` and ``m``). Amplification by sampling
  assumes the cohort stays secret from the adversary (docs/privacy.md says who sees it).
* local DP: the server sees who is in each cohort, so there is no amplification: a client's ε composes the Gaussian
  mechanism over the rounds it took part in, and the run reports the client that took part most.

ε at δ comes from the composed RDP curve (``compute_epsilon``: the conversion of Canonne, Kamath, Steinke 2020,
tighter than ``rdp + log(1/δ)/(α−1)``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as rdp

ORDERS = tuple(rdp.DEFAULT_RDP_ORDERS)


@functools.lru_cache(maxsize=256)
def round_rdp(population: int, cohort: int, noise: float) -> tuple[float, ...]:
    """RDP curve (at :data:`ORDERS`) of one round: a cohort of ``cohort`` of ``population`` clients, noise ``z``."""
    accountant = rdp.RdpAccountant(ORDERS, dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.GaussianDpEvent(noise / 2)  # sensitivity 2C under replace-one
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(population, min(cohort, population), event))
    return tuple(float(v) for v in accountant.rdp)


def epsilon_of(rounds: Iterable[tuple[int, int]], noise: float, delta: float, mode: str = "central") -> float:
    """ε at ``delta`` after ``rounds`` of ``(population, cohort)`` with noise multiplier ``noise`` (0 rounds: 0)."""
    # local DP: no amplification (the server knows the cohort): the Gaussian mechanism itself, q = 1
    curves = [round_rdp(population, cohort, noise) if mode == "central" else round_rdp(1, 1, noise)
              for population, cohort in rounds]  # fmt: skip
    return _epsilon(curves, delta)


def local_epsilon(noises: Iterable[float], delta: float) -> float:
    """ε at ``delta`` of one client's own noised updates, one Gaussian mechanism each (no amplification: local DP)."""
    return _epsilon([round_rdp(1, 1, noise) for noise in noises], delta)


def _epsilon(curves: Iterable[tuple[float, ...]], delta: float) -> float:
    total = np.zeros(len(ORDERS))
    for curve in curves:
        total += np.array(curve)
    if not total.any():
        return 0.0
    eps, _ = rdp.compute_epsilon(ORDERS, total, delta)
    return float(eps)


def planned_epsilon(
    rounds: int, population: int, cohort: int, noise: float, delta: float, mode: str = "central"
) -> float:
    """ε after ``rounds`` rounds of the same population and cohort size (what ``--dp-epsilon`` checks at start)."""
    return epsilon_of([(population, cohort)] * rounds, noise, delta, mode)
