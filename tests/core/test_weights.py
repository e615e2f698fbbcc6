"""Bounded self-reported weights (feast_edge.aggregate.weights): the cap follows the honest lower half, known counts are
never touched, and the run loop records what it lowered (issue 21, item 3)."""

from __future__ import annotations

import math

import pytest

from feast_edge.aggregate.weights import bounded_weights, lower_median, ratio_problem, weight_cap
from feast_edge.settings.nested import SettingsError
from feast_edge.settings.run_concerns import RunConcerns


def test_the_lower_median_is_a_value_of_the_lower_half() -> None:
    assert lower_median([5]) == 5
    assert lower_median([23, 10**6]) == 23  # two counts: the smaller, whatever the other claims
    assert lower_median([23, 40, 10**6]) == 40
    assert lower_median([10**6, 10**6, 23, 40]) == 40  # two of four claim a million: still an honest count
    with pytest.raises(ValueError):
        lower_median([])


def test_a_minority_of_inflated_claims_cannot_raise_the_cap() -> None:
    honest = [23, 30, 41, 52, 60]
    for attackers in range(0, 5):  # fewer than the honest devices: the cap stays at or below the honest maximum's r×
        samples = honest + [10**6] * attackers
        cap = weight_cap(samples, 4.0)
        assert cap is not None and cap <= 4 * max(honest)
        weights = bounded_weights(samples, [False] * len(honest) + [True] * attackers, 4.0)
        assert weights[: len(honest)] == honest and all(w == cap for w in weights[len(honest) :])


def test_only_self_reported_counts_are_capped_and_zero_turns_the_cap_off() -> None:
    samples, reported = [100, 10_000, 10_000], [False, False, True]
    assert bounded_weights(samples, reported, 2.0) == [100, 10_000, 10_000]  # lower median 10,000: cap 20,000
    assert bounded_weights([100, 100, 10_000], [False, True, True], 2.0) == [100, 100, 200]
    assert bounded_weights([100, 100, 10_000], [False, False, False], 2.0) == [100, 100, 10_000]  # known: facts
    assert bounded_weights([100, 100, 10_000], [True, True, True], 0.0) == [100, 100, 10_000]
    assert weight_cap([1, 1, 1], 0.5) == 1  # never below one example
    assert bounded_weights([], [], 4.0) == []
    with pytest.raises(ValueError, match="2 counts but 1"):
        bounded_weights([1, 2], [True], 4.0)


@pytest.mark.parametrize("ratio", [-1.0, math.inf, math.nan])
def test_a_bad_ratio_is_refused_naming_the_option(ratio: float) -> None:
    assert "--max-weight-ratio" in ratio_problem(ratio) and "0: no cap" in ratio_problem(ratio)
    with pytest.raises(SettingsError, match="--max-weight-ratio"):
        RunConcerns.of_keys(rounds=1, per_round=1, max_weight_ratio=ratio)
    assert ratio_problem(0.0) == ratio_problem(4) == ""
