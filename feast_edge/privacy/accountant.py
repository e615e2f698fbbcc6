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
* a stratified draw (``--secure-agg``, feast_edge.run.cohort.stratified_cohort) gives devices of different budget
  tiers different inclusion probabilities; its rounds carry the largest, ``rate``, and are accounted as a uniform
  draw at that rate: PLD at ``q = rate`` exactly, RDP as ``ceil(rate · N)`` of ``N`` (docs/privacy.md says why).
* local DP: the server sees who is in each cohort, so there is no amplification: a client's ε composes the Gaussian
  mechanism over the rounds it took part in, and the run reports the client that took part most.

ε at δ comes from two accountants, and the smaller is reported with its name (:class:`Epsilon`):

* RDP: the composed RDP curve of the events above (``compute_epsilon``: the conversion of Canonne, Kamath, Steinke
  2020, tighter than ``rdp + log(1/δ)/(α−1)``);
* PLD: the privacy loss distribution of the *dominating pair* of a round (Zhu, Dong, Wang 2022, "Optimal accounting
  of differential privacy via characteristic function"): sampling ``m`` of ``N`` without replacement under
  replace-one is dominated by Poisson sampling at ``q = m/N`` of the Gaussian with multiplier ``z/2`` under
  add/remove, which dp-accounting's PLD accountant composes numerically (its pessimistic discretisation: the figure
  is an upper bound). At ``q = 1`` it is the Gaussian mechanism itself. RDP's conversion to (ε, δ) is loose: for 100
  devices, 10 a round, z = 1, 8 rounds, δ = 1e-5 RDP says 16.0 and PLD 11.4, the true worst case of the mechanism
  within the discretisation (Opacus's PRV accountant agrees; tests/core/test_privacy.py checks against Microsoft's
  prv-accountant, an independent implementation).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant as pld
from dp_accounting.rdp import rdp_privacy_accountant as rdp

ORDERS = tuple(rdp.DEFAULT_RDP_ORDERS)
# The PLD's value discretisation, in ε: 1e-2 up to ε = 20, then growing with ε (a pessimistic discretisation stays an
# upper bound; 11.4224 against 11.4222 at 1e-3 for the figure in the docstring, 10x faster; a run with little noise,
# ε in the hundreds, would otherwise take seconds per round).
PLD_INTERVAL = 1e-2
PLD_SCALE_FROM = 20.0
ACCOUNTANTS = {
    "pld": "dp-accounting PLD of the dominating pair (Poisson q = m/N, Gaussian z/2, add/remove; Zhu, Dong, Wang 2022)",
    "rdp": "dp-accounting RDP: fixed-size cohorts sampled without replacement, replace-one, sensitivity 2C",
}


@dataclass(frozen=True)
class Epsilon:
    """ε at δ, the smaller of the two accountants' figures, and which one gave it (``"pld"`` or ``"rdp"``)."""

    value: float
    accountant: str
    rdp: float
    pld: float


@functools.lru_cache(maxsize=256)
def round_rdp(population: int, cohort: int, noise: float) -> tuple[float, ...]:
    """RDP curve (at :data:`ORDERS`) of one round: a cohort of ``cohort`` of ``population`` clients, noise ``z``."""
    accountant = rdp.RdpAccountant(ORDERS, dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.GaussianDpEvent(noise / 2)  # sensitivity 2C under replace-one
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(population, min(cohort, population), event))
    return tuple(float(v) for v in accountant.rdp)


# A round: (population, cohort, noise), or (population, cohort, noise, rate) where the draw is not uniform and
# ``rate`` is the largest probability that one device is in its cohort (None: m / N).
Event = tuple[int, int, float] | tuple[int, int, float, float | None]


def sampling_rate(event: Event) -> float:
    """The round's inclusion probability: its ``rate``, or ``m / N`` for a uniform draw (at least that: a draw of m
    has a device whose inclusion is at least the mean, m / N)."""
    population, cohort = event[0], event[1]
    uniform = min(cohort, population) / population
    rate = event[3] if len(event) > 3 else None
    return uniform if rate is None else min(1.0, max(uniform, float(rate)))


def _rdp_of(event: Event) -> tuple[float, ...]:
    """RDP of one round: m of N without replacement, m raised to ceil(rate · N) where the draw is not uniform."""
    population, _, noise = event[0], event[1], event[2]
    drawn = min(population, math.ceil(sampling_rate(event) * population - 1e-9))
    return round_rdp(population, drawn, noise)


def pld_epsilon(events: Iterable[Event], delta: float, scale: float = 1.0) -> float:
    """ε at ``delta`` of rounds (:data:`Event`) through the PLD of each round's dominating pair (``scale``: the
    discretisation interval's multiple of :data:`PLD_INTERVAL`)."""
    counted = Counter((sampling_rate(e), e[2]) for e in events)
    return _pld_epsilon(tuple(sorted(counted.items())), delta, scale)


@functools.lru_cache(maxsize=1024)
def _pld_epsilon(counted: tuple[tuple[tuple[float, float], int], ...], delta: float, scale: float) -> float:
    if not counted:
        return 0.0
    accountant = pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, PLD_INTERVAL * scale)
    for (q, noise), count in counted:
        gaussian = dp_accounting.GaussianDpEvent(noise / 2)  # sensitivity 2C under replace-one
        accountant.compose(gaussian if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian), count)
    return float(accountant.get_epsilon(delta))


def account(events: Iterable[Event], delta: float) -> Epsilon:
    """ε at ``delta`` of rounds (:data:`Event`): the smaller of RDP and PLD, naming which."""
    events = list(events)
    by_rdp = _epsilon([_rdp_of(e) for e in events], delta)
    by_pld = pld_epsilon(events, delta, round(max(1.0, by_rdp / PLD_SCALE_FROM), 1))
    return Epsilon(min(by_rdp, by_pld), "pld" if by_pld < by_rdp else "rdp", by_rdp, by_pld)


def epsilon_of(rounds: Iterable[tuple], noise: float, delta: float, mode: str = "central") -> float:
    """ε at ``delta`` after ``rounds`` of ``(population, cohort)`` or ``(population, cohort, rate)`` with noise
    multiplier ``noise`` (0 rounds: 0): the smaller of RDP and PLD (:func:`account` names which)."""
    return accounted(rounds, noise, delta, mode).value


def accounted(rounds: Iterable[tuple], noise: float, delta: float, mode: str = "central") -> Epsilon:
    """:func:`epsilon_of` with both accountants' figures and the name of the one reported."""
    # local DP: no amplification (the server knows the cohort): the Gaussian mechanism itself, q = 1
    if mode != "central":
        return account([(1, 1, noise) for _ in rounds], delta)
    return account([(r[0], r[1], noise, r[2] if len(r) > 2 else None) for r in rounds], delta)


def local_epsilon(noises: Iterable[float], delta: float) -> float:
    """ε at ``delta`` of one client's own noised updates, one Gaussian mechanism each (no amplification: local DP)."""
    return account([(1, 1, noise) for noise in noises], delta).value


def _epsilon(curves: Iterable[tuple[float, ...]], delta: float) -> float:
    total = np.zeros(len(ORDERS))
    for curve in curves:
        total += np.array(curve)
    if not total.any():
        return 0.0
    eps, _ = rdp.compute_epsilon(ORDERS, total, delta)
    return float(eps)


def planned_epsilon(
    rounds: int,
    population: int,
    cohort: int,
    noise: float,
    delta: float,
    mode: str = "central",
    rate: float | None = None,
) -> float:
    """ε after ``rounds`` rounds of the same population and cohort size (what ``--dp-epsilon`` checks at start);
    ``rate``: each round's largest inclusion probability where the draw is not uniform."""
    return epsilon_of([(population, cohort, rate)] * rounds, noise, delta, mode)
