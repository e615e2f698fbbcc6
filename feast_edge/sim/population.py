"""Simulated client population: Zipf budgets, γ-allocation, budget-aware Dirichlet partition (method §4).

The data flow, one function per step::

    split  = server_split(len(labels), rng, n_val=4500, n_calib=500)   # server-held data
    b      = zipf_budgets(n_clients, rng)          # or budgets_from_list([...]) for a profile mix
    q      = allocation(b, gamma)                  # q_i(γ), sums to 1
    part   = dirichlet_partition(labels[split.train], q, rng, alpha_eff=0.45)

``build_population`` / ``zipf_population`` run the last three steps and return
one :class:`Population`. Budgets are MACs per example; the raw budget decides
affordability, only the allocation uses the capped ``min(b, B_cap)``. Shards
hold positions into the ``labels`` array given to the partition (map them
through ``split.train`` to get dataset indices). Every random choice draws from
the ``numpy.random.Generator`` passed in, so one seed reproduces a population.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from feast_edge.errors import PopulationError

# Paper defaults (method §4).
ZIPF_S = 1.2
B_MIN = 25e6
B_MAX = 1500e6
B_CAP = 600e6
ALPHA_EFF = 0.45
MIN_SHARD = 10
MAX_DRAWS = 1000


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PopulationError(message)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _check_clients(n_clients: int) -> None:
    _require(
        isinstance(n_clients, (int, np.integer)) and n_clients >= 2,
        f"n_clients = {n_clients} must be an integer >= 2 (the rank-to-budget map divides by N - 1); use at least 2 clients",
    )


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _mmacs(b: float) -> str:
    return f"{b / 1e6:.2f}M"


# --------------------------------------------------------------------------- budgets


def zipf_budgets(
    n_clients: int,
    rng: np.random.Generator,
    *,
    s: float = ZIPF_S,
    b_min: float = B_MIN,
    b_max: float = B_MAX,
) -> np.ndarray:
    """Budgets ``b_i = clip(B_min + (r_i - 1)ΔB + ε_i, B_min, B_max)``, ``r_i ~ Zipf(s)`` on {1..N} (method §4)."""
    _check_clients(n_clients)
    _require(_finite(s) and s >= 0, f"s = {s} must be a finite number >= 0 (0 gives uniform ranks, the paper uses 1.2)")
    _require(_finite(b_min) and b_min > 0, f"b_min = {b_min} must be a positive number of MACs; pass e.g. b_min=25e6")
    _require(_finite(b_max), f"b_max = {b_max} must be a finite number of MACs; pass e.g. b_max=1500e6")
    _require(
        b_min <= b_max,
        f"b_min = {_mmacs(b_min)} MACs is above b_max = {_mmacs(b_max)} MACs; swap them or raise b_max",
    )
    n_ranks = n_clients  # R = N
    ranks = np.arange(1, n_ranks + 1, dtype=np.float64)
    weights = ranks**-s
    r = rng.choice(n_ranks, size=n_clients, p=weights / weights.sum()) + 1
    step = (b_max - b_min) / (n_ranks - 1)
    jitter = rng.uniform(-step / 2, step / 2, size=n_clients)
    return _frozen(np.clip(b_min + (r - 1) * step + jitter, b_min, b_max))


def budgets_from_list(values: Sequence[float]) -> np.ndarray:
    """Budgets (MACs) given explicitly, one per client, e.g. from a profile mix (method §4)."""
    budgets = np.array(values, dtype=np.float64)
    _require(
        budgets.ndim == 1 and len(budgets) >= 2,
        f"got budgets of shape {budgets.shape}; a population needs a flat list of at least 2 budgets, one per client",
    )
    bad = np.flatnonzero(~(np.isfinite(budgets) & (budgets > 0)))
    if len(bad):
        raise PopulationError(
            f"budget of client {bad[0]} is {budgets[bad[0]]}; every budget must be a positive finite number of MACs"
        )
    return _frozen(budgets)


def allocation(budgets: np.ndarray | Sequence[float], gamma: float = 1.0, b_cap: float = B_CAP) -> np.ndarray:
    """γ-allocation ``q_i = b̄_i^γ / Σ_j b̄_j^γ`` with ``b̄ = min(b, B_cap)`` (method §4, paper Eq. 1)."""
    _require(
        _finite(gamma) and gamma >= 0,
        f"gamma = {gamma} must be a finite number >= 0 (0 gives every client the same expected share, the paper uses 1)",
    )
    _require(_finite(b_cap) and b_cap > 0, f"b_cap = {b_cap} must be a positive number of MACs; pass e.g. b_cap=600e6")
    b = budgets_from_list(budgets)
    # In log space so that a large gamma cannot overflow.
    log_w = gamma * np.log(np.minimum(b, b_cap))
    w = np.exp(log_w - log_w.max())
    return _frozen(w / w.sum())


def alpha_data_for(alpha_eff: float, n_train: int, n_classes: int, n_clients: int) -> float:
    """``α_data = α_eff·K·N / N_train``, the inverse of ``α_eff = α_data·N_train/(K·N)`` (method §4)."""
    return alpha_eff * n_classes * n_clients / n_train


def alpha_eff_for(alpha_data: float, n_train: int, n_classes: int, n_clients: int) -> float:
    """``α_eff = α_data·N_train / (K·N)`` (method §4)."""
    return alpha_data * n_train / (n_classes * n_clients)


# --------------------------------------------------------------------------- partition


@dataclass(frozen=True, eq=False)
class Partition:
    """Disjoint, exhaustive client shards of a training pool and the statistics method §4 reports."""

    shards: tuple[np.ndarray, ...]  # sorted positions into the pool, one array per client
    classes: np.ndarray  # class label of each column of ``class_counts``
    class_counts: np.ndarray  # (n_clients, n_classes) examples of each class per client
    alpha_data: float
    alpha_eff: float
    draws: int  # full draws needed until every client had enough examples

    @property
    def n_clients(self) -> int:
        return len(self.shards)

    @property
    def n_train(self) -> int:
        return int(self.class_counts.sum())

    @property
    def sizes(self) -> np.ndarray:
        """Realized shard sizes ``n_i`` (the aggregation weights)."""
        return self.class_counts.sum(axis=1)

    @property
    def shares(self) -> np.ndarray:
        """Realized data shares ``n_i / N_train``."""
        return self.sizes / self.n_train

    @property
    def size_range(self) -> tuple[int, int]:
        """Smallest and largest shard size."""
        return int(self.sizes.min()), int(self.sizes.max())

    def __str__(self) -> str:
        lo, hi = self.size_range
        return (
            f"{self.n_clients} clients, {self.n_train} examples, {len(self.classes)} classes, "
            f"alpha_eff={self.alpha_eff:.4g} (alpha_data={self.alpha_data:.4g}), "
            f"shard sizes {lo}..{hi}, {self.draws} draw(s)"
        )


def _class_positions(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    classes, inverse = np.unique(labels, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(classes)))[:-1]
    return classes, np.split(order, bounds)


def _draw_owners(
    positions: list[np.ndarray], q: np.ndarray, alpha_data: float, n_train: int, rng: np.random.Generator
) -> np.ndarray | None:
    """One full draw: owner client of every pool position, or None if a class had no open client mass."""
    n_clients = len(q)
    cap = q * n_train
    counts = np.zeros(n_clients, dtype=np.int64)
    owner = np.empty(n_train, dtype=np.int64)
    for pos in positions:
        n_k = len(pos)
        shuffled = rng.permutation(pos)
        p = rng.dirichlet(alpha_data * n_k * q)
        p = np.where(counts < cap, p, 0.0)  # clients at their balancing cap take no more
        cum = np.cumsum(p)
        if not cum[-1] > 0:  # all open mass underflowed to zero: redraw everything
            return None
        # Renormalize by the cumsum's own last value so that trailing masked clients sit at
        # exactly 1.0 and get no rounding leftover (p / p.sum() can cumsum to 1 - 1e-16).
        cuts = np.floor(n_k * (cum[:-1] / cum[-1])).astype(np.int64)
        seg = np.diff(np.concatenate(([0], np.clip(cuts, 0, n_k), [n_k])))
        owner[shuffled] = np.repeat(np.arange(n_clients), seg)
        counts += seg
    return owner


def _check_q(q: np.ndarray) -> None:
    _require(q.ndim == 1 and len(q) >= 2, f"q has shape {q.shape}; it needs one allocation weight per client (>= 2)")
    _require(
        bool(np.all(np.isfinite(q)) and np.all(q > 0)) and abs(q.sum() - 1) < 1e-9,
        "q must be positive weights summing to 1; build it with allocation(budgets, gamma)",
    )


def dirichlet_partition(
    labels: np.ndarray | Sequence[int],
    q: np.ndarray | Sequence[float],
    rng: np.random.Generator,
    *,
    alpha_eff: float = ALPHA_EFF,
    min_shard: int = MIN_SHARD,
    max_draws: int = MAX_DRAWS,
) -> Partition:
    """Budget-aware Dirichlet partition ``p_k ~ Dir(α_data·N_k·q)`` with cap masking and redraws (method §4)."""
    labels = np.asarray(labels)
    q = np.asarray(q, dtype=np.float64)
    _require(labels.ndim == 1 and len(labels) > 0, f"labels has shape {labels.shape}; pass a non-empty 1-D label array")
    _check_q(q)
    _require(_finite(alpha_eff) and alpha_eff > 0, f"alpha_eff = {alpha_eff} must be > 0 (the paper uses 0.45)")
    _require(min_shard >= 1, f"min_shard = {min_shard} must be >= 1 (the paper uses 10)")
    _require(max_draws >= 1, f"max_draws = {max_draws} must be >= 1")
    n_train, n_clients = len(labels), len(q)
    _require(
        n_train >= min_shard * n_clients,
        f"too few examples: {n_train} training examples cannot give {n_clients} clients at least {min_shard} each; "
        f"use at most {n_train // min_shard} clients or more data",
    )
    classes, positions = _class_positions(labels)
    alpha_data = alpha_data_for(alpha_eff, n_train, len(classes), n_clients)
    smallest = 0
    for draw in range(1, max_draws + 1):
        owner = _draw_owners(positions, q, alpha_data, n_train, rng)
        if owner is None:
            continue
        sizes = np.bincount(owner, minlength=n_clients)
        if sizes.min() < min_shard:
            smallest = max(smallest, int(sizes.min()))
            continue
        return _partition(owner, positions, classes, n_clients, alpha_data, alpha_eff, draw)
    raise PopulationError(
        f"no partition in {max_draws} draws gave every one of {n_clients} clients at least {min_shard} examples "
        f"(best smallest shard: {smallest}); raise alpha_eff (now {alpha_eff:g}), lower gamma, use fewer clients "
        "or raise max_draws"
    )


def _partition(
    owner: np.ndarray,
    positions: list[np.ndarray],
    classes: np.ndarray,
    n_clients: int,
    alpha_data: float,
    alpha_eff: float,
    draws: int,
) -> Partition:
    order = np.argsort(owner, kind="stable")  # positions grouped by client, ascending within each
    sizes = np.bincount(owner, minlength=n_clients)
    shards = tuple(_frozen(s) for s in np.split(order, np.cumsum(sizes)[:-1]))
    counts = np.stack([np.bincount(owner[pos], minlength=n_clients) for pos in positions], axis=1)
    return Partition(shards, _frozen(classes), _frozen(counts), alpha_data, alpha_eff, draws)


# --------------------------------------------------------------------------- population


@dataclass(frozen=True, eq=False)
class Population:
    """N simulated clients: raw budgets, γ-allocation and their data shards (method §4)."""

    budgets: np.ndarray  # raw b_i in MACs; affordability uses these
    gamma: float
    b_cap: float
    allocation: np.ndarray  # q_i(γ), sums to 1
    partition: Partition

    @property
    def n_clients(self) -> int:
        return len(self.budgets)

    @property
    def alpha_eff(self) -> float:
        return self.partition.alpha_eff

    @property
    def sizes(self) -> np.ndarray:
        """Realized shard sizes ``n_i``."""
        return self.partition.sizes

    @property
    def capped_budgets(self) -> np.ndarray:
        """``b̄_i = min(b_i, B_cap)``, the budgets the allocation uses."""
        return np.minimum(self.budgets, self.b_cap)

    def __str__(self) -> str:
        return (
            f"population of {self.n_clients} clients, budgets {_mmacs(self.budgets.min())}..{_mmacs(self.budgets.max())} "
            f"MACs, gamma={self.gamma:g}, B_cap={_mmacs(self.b_cap)}; {self.partition}"
        )


def build_population(
    labels: np.ndarray | Sequence[int],
    budgets: np.ndarray | Sequence[float],
    rng: np.random.Generator,
    *,
    gamma: float = 1.0,
    alpha_eff: float = ALPHA_EFF,
    b_cap: float = B_CAP,
    min_shard: int = MIN_SHARD,
    max_draws: int = MAX_DRAWS,
) -> Population:
    """Population with the given budgets: γ-allocation, then the budget-aware partition (method §4)."""
    b = budgets_from_list(budgets)
    q = allocation(b, gamma, b_cap)
    part = dirichlet_partition(labels, q, rng, alpha_eff=alpha_eff, min_shard=min_shard, max_draws=max_draws)
    return Population(b, float(gamma), float(b_cap), q, part)


def zipf_population(
    labels: np.ndarray | Sequence[int],
    n_clients: int,
    rng: np.random.Generator,
    *,
    s: float = ZIPF_S,
    b_min: float = B_MIN,
    b_max: float = B_MAX,
    gamma: float = 1.0,
    alpha_eff: float = ALPHA_EFF,
    b_cap: float = B_CAP,
    min_shard: int = MIN_SHARD,
    max_draws: int = MAX_DRAWS,
) -> Population:
    """The paper's simulated population: Zipf budgets, then :func:`build_population` (method §4)."""
    budgets = zipf_budgets(n_clients, rng, s=s, b_min=b_min, b_max=b_max)
    return build_population(
        labels, budgets, rng, gamma=gamma, alpha_eff=alpha_eff, b_cap=b_cap, min_shard=min_shard, max_draws=max_draws
    )


# --------------------------------------------------------------------------- server data and cohorts


class ServerSplit(NamedTuple):
    """Sorted dataset positions: client-training pool, server validation, BN-calibration (method §4)."""

    train: np.ndarray
    validation: np.ndarray
    calibration: np.ndarray


def server_split(n_examples: int, rng: np.random.Generator, *, n_val: int, n_calib: int) -> ServerSplit:
    """Hold out disjoint validation and BN-calibration sets for the server; the rest trains clients (method §4)."""
    _require(n_val >= 0 and n_calib >= 0, f"n_val = {n_val} and n_calib = {n_calib} must both be >= 0")
    _require(
        n_val + n_calib < n_examples,
        f"n_val + n_calib = {n_val + n_calib} leaves no training data out of {n_examples} examples; hold out fewer",
    )
    perm = rng.permutation(n_examples)
    val, calib, train = np.split(perm, [n_val, n_val + n_calib])
    return ServerSplit(_frozen(np.sort(train)), _frozen(np.sort(val)), _frozen(np.sort(calib)))
