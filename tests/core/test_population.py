"""Client population: Zipf budgets, γ-allocation, budget-aware Dirichlet partition (method §4)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.errors import FeastError, PopulationError
from feast_edge.run.cohort import CohortError, sample_cohort
from feast_edge.sim.population import (
    allocation,
    alpha_data_for,
    alpha_eff_for,
    budgets_from_list,
    build_population,
    dirichlet_partition,
    server_split,
    zipf_budgets,
    zipf_population,
)


def _labels(n_classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(n_classes), per_class)


# --------------------------------------------------------------------------- budgets


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(2, 300),
    s=st.floats(0, 4),
    b_min=st.floats(1e6, 1e9),
    span=st.floats(0, 2e9),
    seed=st.integers(0, 2**32 - 1),
)
def test_budgets_lie_in_range_within_half_a_step_of_a_rank(n, s, b_min, span, seed):
    b_max = b_min + span
    b = zipf_budgets(n, np.random.default_rng(seed), s=s, b_min=b_min, b_max=b_max)
    assert b.shape == (n,)
    assert np.all((b >= b_min) & (b <= b_max))
    step = (b_max - b_min) / (n - 1)
    if step > 0:
        offset = (b - b_min) / step  # = r - 1 + ε/ΔB with |ε/ΔB| <= 1/2
        assert np.all(np.abs(offset - np.round(offset)) <= 0.5 + 1e-9)


def test_rank_frequencies_follow_zipf():
    n, s = 100, 1.2
    rng = np.random.default_rng(0)
    b = np.concatenate([zipf_budgets(n, rng, s=s) for _ in range(200)])
    step = (1500e6 - 25e6) / (n - 1)
    rank = np.clip(np.round((b - 25e6) / step), 0, n - 1) + 1  # clipping only ever pulls into the edge ranks
    p = np.arange(1, n + 1) ** -s
    p /= p.sum()
    for r in (1, 2, 5):
        assert abs(np.mean(rank == r) - p[r - 1]) < 0.015


def test_huge_exponent_puts_everyone_at_the_lowest_rank():
    b = zipf_budgets(50, np.random.default_rng(1), s=60.0, b_min=25e6, b_max=1500e6)
    assert np.all(b <= 25e6 + (1500e6 - 25e6) / 49 / 2)


def test_same_seed_same_budgets():
    a = zipf_budgets(100, np.random.default_rng(7))
    b = zipf_budgets(100, np.random.default_rng(7))
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_clients": 1}, "n_clients = 1"),
        ({"n_clients": 10, "b_min": 2e9, "b_max": 1e9}, "b_min .* above b_max"),
        ({"n_clients": 10, "b_min": 0.0}, "b_min = 0.0"),
        ({"n_clients": 10, "s": -1.0}, "s = -1.0"),
    ],
)
def test_budget_errors_name_the_parameter(kwargs, match):
    with pytest.raises(PopulationError, match=match) as err:
        zipf_budgets(rng=np.random.default_rng(0), **kwargs)
    assert isinstance(err.value, FeastError) and isinstance(err.value, ValueError)


def test_budgets_from_list_validates():
    assert np.array_equal(budgets_from_list([25e6, 600e6, 1e9]), [25e6, 600e6, 1e9])
    for bad in ([25e6], [25e6, -1.0], [25e6, float("nan")], [[25e6, 30e6]]):
        with pytest.raises(PopulationError):
            budgets_from_list(bad)


# --------------------------------------------------------------------------- allocation


def test_allocation_is_capped_budget_to_the_gamma():
    b = np.array([25e6, 100e6, 600e6, 1500e6])
    np.testing.assert_allclose(allocation(b, 0.0), np.full(4, 0.25))
    capped = np.array([25e6, 100e6, 600e6, 600e6])
    np.testing.assert_allclose(allocation(b, 1.0), capped / capped.sum())
    np.testing.assert_allclose(allocation(b, 2.0), capped**2 / (capped**2).sum())
    q = allocation(b, 1.0, b_cap=1e12)
    np.testing.assert_allclose(q, b / b.sum())


def test_allocation_survives_large_gamma():
    q = allocation(np.array([25e6, 600e6, 50e6]), 400.0)
    assert np.all(np.isfinite(q)) and abs(q.sum() - 1) < 1e-12 and q.argmax() == 1


@pytest.mark.parametrize(
    ("gamma", "b_cap", "match"), [(-0.5, 600e6, "gamma = -0.5"), (float("nan"), 600e6, "gamma"), (1.0, 0.0, "b_cap")]
)
def test_allocation_errors(gamma, b_cap, match):
    with pytest.raises(PopulationError, match=match):
        allocation([25e6, 50e6], gamma, b_cap)


def test_alpha_eff_matches_the_paper_table():
    # CIFAR-100: 45,000 training examples, 100 classes, 100 clients (paper Table 12).
    for alpha_data, alpha_eff in [(0.05, 0.225), (0.10, 0.45), (0.30, 1.35), (1.00, 4.5)]:
        assert alpha_eff_for(alpha_data, 45000, 100, 100) == pytest.approx(alpha_eff)
        assert alpha_data_for(alpha_eff, 45000, 100, 100) == pytest.approx(alpha_data)


# --------------------------------------------------------------------------- partition


@settings(max_examples=40, deadline=None)
@given(
    n_clients=st.integers(2, 12),
    n_classes=st.integers(4, 10),
    per_class=st.integers(0, 40),
    gamma=st.floats(0, 1),
    alpha_eff=st.floats(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_partition_is_disjoint_exhaustive_and_large_enough(n_clients, n_classes, per_class, gamma, alpha_eff, seed):
    # Feasible settings only: with very few classes or tiny alpha_eff the protocol itself
    # rarely gives every client 10 examples (test_exhausted_draws_name_the_knobs covers that).
    rng = np.random.default_rng(seed)
    labels = rng.permutation(_labels(n_classes, 40 * n_clients // n_classes + per_class + 1))
    budgets = zipf_budgets(n_clients, rng, b_min=25e6, b_max=100e6)
    pop = build_population(labels, budgets, rng, gamma=gamma, alpha_eff=alpha_eff)
    part = pop.partition
    every = np.concatenate(part.shards)
    assert np.array_equal(np.sort(every), np.arange(len(labels)))  # disjoint and exhaustive
    assert part.sizes.min() >= 10
    assert np.all(np.diff(every[: len(part.shards[0])]) > 0)  # each shard sorted
    for i, shard in enumerate(part.shards):
        assert np.array_equal(part.class_counts[i], [np.sum(labels[shard] == k) for k in part.classes])
    assert np.all((pop.budgets >= 25e6) & (pop.budgets <= 100e6))
    assert part.alpha_eff == pytest.approx(alpha_eff)
    # Classes go in order; a client that reached its cap q_i·N_train gets nothing from later classes.
    before = np.cumsum(part.class_counts, axis=1) - part.class_counts
    capped = before >= pop.allocation[:, None] * len(labels)
    assert np.all(part.class_counts[capped] == 0)


def _mean_shares(q: np.ndarray, seeds: int, **kwargs) -> np.ndarray:
    labels = _labels(5, 400)
    return np.mean(
        [dirichlet_partition(labels, q, np.random.default_rng(s), **kwargs).shares for s in range(seeds)], axis=0
    )


def test_mean_realized_share_tracks_the_allocation():
    q = allocation([25e6, 50e6, 100e6, 200e6, 1500e6], 1.0)
    np.testing.assert_allclose(_mean_shares(q, 150, alpha_eff=1.0), q, atol=0.02)


def test_gamma_zero_gives_equal_expected_shares():
    q = allocation([25e6, 50e6, 100e6, 200e6, 1500e6], 0.0)
    np.testing.assert_allclose(_mean_shares(q, 150, alpha_eff=1.0), np.full(5, 0.2), atol=0.02)


def test_gamma_shifts_data_towards_large_budgets():
    b = [25e6, 25e6, 600e6, 600e6]
    labels = _labels(10, 100)
    small = [build_population(labels, b, np.random.default_rng(s), gamma=1.0).sizes[:2].sum() for s in range(20)]
    equal = [build_population(labels, b, np.random.default_rng(s), gamma=0.0).sizes[:2].sum() for s in range(20)]
    assert np.mean(small) < 0.5 * np.mean(equal)


def test_same_seed_same_partition():
    labels = _labels(10, 60)
    a = zipf_population(labels, 8, np.random.default_rng(3))
    b = zipf_population(labels, 8, np.random.default_rng(3))
    c = zipf_population(labels, 8, np.random.default_rng(4))
    assert np.array_equal(a.budgets, b.budgets)
    assert all(np.array_equal(x, y) for x, y in zip(a.partition.shards, b.partition.shards))
    assert not all(np.array_equal(x, y) for x, y in zip(a.partition.shards, c.partition.shards))


def test_population_reports_its_statistics():
    pop = zipf_population(_labels(10, 100), 10, np.random.default_rng(0))
    lo, hi = pop.partition.size_range
    assert lo == pop.sizes.min() >= 10 and hi == pop.sizes.max()
    assert pop.partition.class_counts.shape == (10, 10)
    assert np.allclose(pop.capped_budgets, np.minimum(pop.budgets, 600e6))
    text = str(pop)
    assert "alpha_eff=0.45" in text and f"{lo}..{hi}" in text
    with pytest.raises(ValueError):
        pop.budgets[0] = 1.0  # value type: arrays are read-only


def test_too_few_examples_is_reported_before_drawing():
    with pytest.raises(PopulationError, match="too few examples: 95 .* 10 clients .* at most 9 clients"):
        dirichlet_partition(_labels(5, 19), allocation(np.full(10, 1e8), 1.0), np.random.default_rng(0))


def test_exhausted_draws_name_the_knobs():
    with pytest.raises(PopulationError, match="raise alpha_eff .*lower gamma"):
        dirichlet_partition(
            _labels(2, 100), allocation([25e6] * 19 + [600e6], 2.0), np.random.default_rng(0), max_draws=5
        )


@pytest.mark.parametrize(
    ("labels", "q", "kwargs", "match"),
    [
        ([], [0.5, 0.5], {}, "labels"),
        ([0] * 40, [1.0], {}, "per client"),
        ([0] * 40, [0.7, 0.7], {}, "summing to 1"),
        ([0] * 40, [0.5, 0.5], {"alpha_eff": 0.0}, "alpha_eff = 0.0"),
    ],
)
def test_partition_input_errors(labels, q, kwargs, match):
    with pytest.raises(PopulationError, match=match):
        dirichlet_partition(labels, q, np.random.default_rng(0), **kwargs)


# --------------------------------------------------------------------------- server data and cohorts


def test_server_split_is_disjoint_and_exhaustive():
    split = server_split(50000, np.random.default_rng(0), n_val=4500, n_calib=500)
    assert (len(split.train), len(split.validation), len(split.calibration)) == (45000, 4500, 500)
    assert np.array_equal(np.sort(np.concatenate(split)), np.arange(50000))
    with pytest.raises(PopulationError, match="n_val"):
        server_split(100, np.random.default_rng(0), n_val=90, n_calib=10)


def test_cohort_is_uniform_without_replacement():
    rng = np.random.default_rng(0)
    cohorts = [sample_cohort(100, 10, rng) for _ in range(2000)]
    assert all(len(np.unique(c)) == 10 for c in cohorts)
    hits = np.bincount(np.concatenate(cohorts), minlength=100)
    assert hits.min() > 120 and hits.max() < 280  # expected 200 each
    with pytest.raises(CohortError, match="cohort size m = 11"):
        sample_cohort(10, 11, rng)
