"""Per-target GA (method §3): determinism, feasibility, operators, post-hoc extraction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.cache.fitness import OVER_RHO, evaluate, population_evaluator
from feast_edge.cache.search import (
    SearchError,
    best_arch_under,
    crossover,
    decode,
    encode,
    extraction_rho0,
    gene_box,
    gene_highs,
    initial_population,
    mutate,
    search_target,
    split_genes,
    tournament,
)
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import load_preset
from strategies import archs

FMNIST = load_preset("fmnist-small")
SMALL = dict(population=32, generations=24)


@pytest.fixture(scope="module")
def cifar():
    return load_preset("paper-cifar100")


def test_same_seed_same_result(cifar):
    a = search_target(cifar, 120e6, 0.31, seed=5, **SMALL)
    b = search_target(cifar, 120e6, 0.31, seed=5, **SMALL)
    assert a == b
    c = search_target(cifar, 120e6, 0.31, seed=6, **SMALL)
    assert c.history != a.history


@pytest.mark.parametrize("target, rho0", [(25e6, 0.40), (120e6, 0.31), (600e6, 0.31)])
def test_result_is_feasible_and_within_budget(cifar, target, rho0):
    result = search_target(cifar, target, rho0, seed=0, **SMALL)
    assert result.fitness.feasible
    assert result.fitness.macs == arch_cost(cifar, result.arch)[0] <= target
    assert result.fitness.rho <= rho0
    assert result.fitness == evaluate(cifar, result.arch, target, rho0)
    assert result.fitness.fitness == pytest.approx(result.history[-1], rel=1e-12)


def test_best_ever_history_never_decreases(cifar):
    history = np.array(search_target(cifar, 300e6, 0.31, seed=1, **SMALL).history)
    assert len(history) == SMALL["generations"] + 1
    assert (np.diff(history) >= 0).all() and history[-1] > history[0]


def test_ga_finds_the_exhaustive_optimum_of_a_tiny_space(tiny):
    highs = gene_highs(tiny)
    grid = np.stack(np.meshgrid(*[np.arange(h) for h in highs], indexing="ij"), -1).reshape(-1, highs.size)
    target, rho0 = 1_000_000, 0.35
    best = population_evaluator(tiny).evaluate(*split_genes(tiny, grid), target, rho0).fitness.max()
    found = [
        search_target(tiny, target, rho0, seed=s, population=128, generations=128).fitness.fitness for s in range(8)
    ]
    # a GA may stall in a local optimum now and then, but not usually
    assert sum(f == pytest.approx(best, rel=1e-12) for f in found) >= 6
    assert max(found) == pytest.approx(best, rel=1e-12)


def test_initial_population_is_feasible(cifar):
    evaluator = population_evaluator(cifar)
    pop = initial_population(evaluator, 25e6, 0.40, 64, np.random.default_rng(0))
    got = evaluator.evaluate(*split_genes(cifar, pop), 25e6, 0.40)
    assert pop.shape == (64, 13) and got.feasible.all()


def test_target_below_the_smallest_arch_is_rejected(cifar):
    with pytest.raises(
        SearchError, match=r"below the smallest architecture of preset paper-cifar100; raise the target"
    ):
        search_target(cifar, 3e6, 0.40, seed=0, **SMALL)


def test_unreachable_ceiling_is_rejected():
    # every architecture under 1.5M MACs of fmnist-small has rho >= 0.334 (see its TOML)
    with pytest.raises(SearchError, match=r"only 0 of .* feasible.*raise the target or rho0"):
        initial_population(population_evaluator(FMNIST), 1.5e6, 0.31, 8, np.random.default_rng(0), max_draws=1 << 15)


@settings(max_examples=80, deadline=None)
@given(arch=archs(FMNIST), target=st.floats(1.4e6, 60e6))
def test_gene_box_holds_every_arch_within_the_target(arch, target):
    box = gene_box(population_evaluator(FMNIST), target)
    if arch_cost(FMNIST, arch)[0] <= target:
        assert (encode(FMNIST, arch) < box).all()


@settings(max_examples=80, deadline=None)
@given(arch=archs(FMNIST), gene=st.integers(0, 12))
def test_macs_grow_with_every_gene(arch, gene):
    # gene_box relies on this monotonicity
    genes = encode(FMNIST, arch)
    if genes[gene] + 1 < gene_highs(FMNIST)[gene]:
        bigger = genes.copy()
        bigger[gene] += 1
        assert arch_cost(FMNIST, decode(FMNIST, bigger))[0] >= arch_cost(FMNIST, arch)[0]


@settings(max_examples=40, deadline=None)
@given(arch=archs(load_preset("paper-cifar100")))
def test_encode_decode_round_trip(arch):
    cifar = load_preset("paper-cifar100")
    assert decode(cifar, encode(cifar, arch)) == arch.validated(cifar)


def test_tournament_returns_the_best_of_its_picks():
    fitness = np.arange(10.0)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    winners = tournament(fitness, rng_a)
    picks = rng_b.integers(0, 10, size=(10, 3))
    assert (winners == picks.max(axis=1)).all()


def test_crossover_swaps_tails_of_consecutive_pairs():
    parents = np.array([[0] * 6, [1] * 6, [2] * 6, [3] * 6, [4] * 6])
    children = crossover(parents, np.random.default_rng(0))
    for i in (0, 2):
        a, b = children[i], children[i + 1]
        point = int(np.argmax(a != parents[i]))
        assert 1 <= point < 6
        assert (a[:point] == parents[i][0]).all() and (a[point:] == parents[i + 1][0]).all()
        assert (b[:point] == parents[i + 1][0]).all() and (b[point:] == parents[i][0]).all()
    assert (children[4] == parents[4]).all()  # odd one out passes through


def test_mutation_changes_at_most_one_gene_and_keeps_feasibility(cifar):
    evaluator = population_evaluator(cifar)
    rng = np.random.default_rng(1)
    pop = initial_population(evaluator, 60e6, 0.31, 256, rng)
    fit = evaluator.evaluate(*split_genes(cifar, pop), 60e6, 0.31).fitness
    mutated, mutated_fit = mutate(evaluator, pop, fit, 60e6, 0.31, rng)
    changed = (mutated != pop).sum(axis=1)
    assert changed.max() == 1 and 0.12 < (changed == 1).mean() < 0.36
    assert (mutated_fit > OVER_RHO).all()
    assert np.allclose(mutated_fit, evaluator.evaluate(*split_genes(cifar, mutated), 60e6, 0.31).fitness)


def test_extraction_ceiling_is_preset_data(cifar, tiny):
    assert extraction_rho0(cifar, 30e6) == 0.40
    assert extraction_rho0(cifar, 50e6) == 0.31
    assert extraction_rho0(cifar, 400e6) == 0.31
    with pytest.raises(SearchError, match="defines no extraction ceilings.*pass rho0 explicitly"):
        extraction_rho0(tiny, 1e6)


def test_best_arch_under(cifar):
    result = best_arch_under(cifar, 40e6, seed=3, population=32, generations=16)
    assert result.rho0 == 0.40 and result.fitness.macs <= 40e6 and result.fitness.rho <= 0.40
    assert best_arch_under(cifar, 40e6, seed=3, population=32, generations=16) == result
    explicit = best_arch_under(cifar, 40e6, rho0=0.31, seed=3, population=32, generations=16)
    assert explicit.rho0 == 0.31 and explicit.fitness.rho <= 0.31
    with pytest.raises(SearchError, match=r"budget 1.000M MACs is below the smallest architecture"):
        best_arch_under(cifar, 1e6)


def test_bad_settings_are_rejected(cifar):
    with pytest.raises(SearchError, match="population >= 2"):
        search_target(cifar, 100e6, 0.31, seed=0, population=1, generations=4)
