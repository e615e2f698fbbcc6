"""Bounded influence of self-reported sample counts (issue 21, item 3).

method §6 weighs each client's update by its sample count ``n_i``. Where the
server knows the counts (the simulation's shards, a partitioned federation's
record) they are facts; where a device reports its own (a device training on
its own data) the count is a claim, and one device claiming 10⁶ examples
outweighs a cohort of honest 50-example devices 20,000 to 1. The bound::

    m      = lower median of the round's valid counts (self-reported and known alike)
    cap    = max(1, ⌊r · m⌋)                     r = --max-weight-ratio (0: no cap)
    w_i    = min(n_i, cap)   for a self-reported count,   w_i = n_i   for a known one

A device counts for at most ``r`` median devices. The lower median (the
⌈k/2⌉-th smallest of k counts) is a value some device of the lower half
reported, so devices claiming large counts cannot raise the cap unless they
are more than half of the round's valid updates; with two updates it is the
smaller one. On a position covered by the attacker and ``j`` honest devices
of about the median count, the attacker's share of the weighted mean is at
most ``r / (r + j)``: 4/5 with two honest devices beside it at the default r = 8, 2/3 with four.

An honest device with more than ``r`` times the median's data loses weight
too: what that costs is measured in docs/benchmarks.md ("Bounded weights").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_WEIGHT_RATIO = 8.0  # feast-server run's --max-weight-ratio (simulation: 0, the paper's protocol)


def lower_median(values: Sequence[int]) -> int:
    """The ⌈k/2⌉-th smallest of ``values`` (k ≥ 1): a value the lower half holds, whatever the upper half claims."""
    if not values:
        raise ValueError("the lower median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def ratio_problem(ratio: float) -> str:
    """Why ``ratio`` cannot be a --max-weight-ratio, or ""."""
    ok = isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 0
    return "" if ok else f"--max-weight-ratio {ratio} must be a finite number >= 0 (0: no cap)"


def weight_cap(samples: Sequence[int], ratio: float) -> int | None:
    """The most a self-reported count may weigh in a round of these valid ``samples``; None when ``ratio`` is 0 (no cap)."""
    problem = ratio_problem(ratio)
    if problem:
        raise ValueError(problem)
    if not ratio or not samples:
        return None
    return max(1, math.floor(ratio * lower_median(samples)))


def bounded_weights(
    samples: Sequence[int], self_reported: Sequence[bool], ratio: float, reference: Sequence[int] = ()
) -> list[int]:
    """Each update's aggregation weight: its count, or the :func:`weight_cap` of ``reference`` (default: the round's own
    counts) where the count is self-reported and above it. An asynchronous release of K updates takes the latest
    count of every device heard from as ``reference``: the lower median of two or three counts is one device's."""
    if len(samples) != len(self_reported):
        raise ValueError(f"{len(samples)} counts but {len(self_reported)} self-reported flags")
    cap = weight_cap(reference or samples, ratio)
    return [n if cap is None or not reported else min(n, cap) for n, reported in zip(samples, self_reported)]
