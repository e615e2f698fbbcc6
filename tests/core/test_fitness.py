"""Training-free fitness (method §3): oracle values and scalar == vectorized."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings

from feast_edge.cache.fitness import OVER_BUDGET, OVER_RHO, depth_penalty, evaluate, population_evaluator, width_penalty
from feast_edge.cache.search import encode, split_genes
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset
from strategies import all_presets, archs

SPEC_VECTORS = [
    ("d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]", 2657.5031, 0.391269, 2413.1830),
    ("d=[8,8,8,8] e=[0.18,0.1,0.1,0.1] w=[9,4,6,7,6]", 5179.2155, 0.120441, 5068.7741),
]


@pytest.fixture(scope="module")
def cifar():
    return load_preset("paper-cifar100")


@pytest.mark.parametrize("text, fitness, rho, entropy", SPEC_VECTORS)
def test_spec_test_vectors(cifar, text, fitness, rho, entropy):
    f = evaluate(cifar, Arch.parse(text))
    assert f.fitness == pytest.approx(fitness, abs=5e-5)
    assert f.rho == pytest.approx(rho, abs=5e-7)
    assert f.entropy == pytest.approx(entropy, abs=5e-5)


def test_reference_cache_rows(cifar, reference_cache_csv):
    rows = list(csv.DictReader(reference_cache_csv.open()))
    assert len(rows) == 56
    for row in rows:
        arch = Arch(d=json.loads(row["d"]), e=json.loads(row["e"]), w=json.loads(row["w_indices"]))
        f = evaluate(cifar, arch, float(row["job_target_macs"]), 0.40, classes=10)
        assert f.macs == int(row["macs"]), arch
        assert f.fitness == pytest.approx(float(row["fitness_score"]), rel=1e-10), arch
        assert f.rho == pytest.approx(float(row["effectiveness"]), rel=1e-10), arch
        assert f.entropy == pytest.approx(float(row["entropy"]), rel=1e-10), arch


def test_infeasible_sentinels(cifar):
    arch = Arch.parse(SPEC_VECTORS[0][0])
    f = evaluate(cifar, arch)
    assert evaluate(cifar, arch, max_macs=f.macs - 1).fitness == OVER_BUDGET
    assert evaluate(cifar, arch, rho0=f.rho - 1e-6).fitness == OVER_RHO
    # over budget wins over over-ceiling
    assert evaluate(cifar, arch, max_macs=f.macs - 1, rho0=0.0).fitness == OVER_BUDGET
    # the boundary is feasible: MAC(a) <= B and rho(a) <= rho0
    assert evaluate(cifar, arch, max_macs=f.macs, rho0=f.rho).fitness == f.fitness


def test_width_penalty_counts_decreasing_stage_widths_only(cifar):
    # stem (w0 = 9, 64 ch) wider than stage 1 is not penalised; stage 2 -> 3 shrinking is.
    layout = arch_layout(cifar, Arch.parse("d=[0,0,0,0] e=[0.1,0.1,0.1,0.1] w=[9,0,9,0,0]"))
    c = [s.channels for s in layout.stages]
    assert width_penalty(layout) == c[1] - c[2] > 0


def test_depth_penalty_is_beta_times_exp_variance(cifar):
    layout = arch_layout(cifar, Arch.parse("d=[0,2,0,2] e=[0.1,0.1,0.1,0.1] w=[0,0,0,0,0]"))
    assert depth_penalty(layout) == pytest.approx(10 * math.exp(1.0))
    assert depth_penalty(layout, beta=1.0) == pytest.approx(math.exp(1.0))


@pytest.mark.parametrize("preset", all_presets(), ids=lambda p: p.name)
def test_vectorized_equals_scalar(preset):
    rng = np.random.default_rng(7)
    n, size = preset.num_stages, 300
    d = rng.integers(0, preset.max_extra_blocks + 1, (size, n))
    e = rng.integers(0, len(preset.expansion_ratios), (size, n))
    w = rng.integers(0, len(preset.width_multipliers), (size, n + 1))
    evaluator = population_evaluator(preset)
    unconstrained = evaluator.evaluate(d, e, w)
    budget, rho0 = float(np.median(unconstrained.macs)), float(np.median(unconstrained.rho))
    got = evaluator.evaluate(d, e, w, budget, rho0)
    assert got.feasible.any() and not got.feasible.all()
    for i in range(size):
        arch = Arch(d=tuple(map(int, d[i])), e=tuple(preset.expansion_ratios[j] for j in e[i]), w=tuple(map(int, w[i])))
        want = evaluate(preset, arch, budget, rho0)
        assert got.macs[i] == want.macs == arch_cost(preset, arch)[0]
        assert got.fitness[i] == pytest.approx(want.fitness, rel=1e-12)
        assert got.rho[i] == pytest.approx(want.rho, rel=1e-12)
        assert got.entropy[i] == pytest.approx(want.entropy, rel=1e-12)


@pytest.mark.parametrize("classes", [None, 10])
def test_vectorized_macs_follow_the_head(cifar, classes):
    arch = Arch.parse(SPEC_VECTORS[1][0])
    got = population_evaluator(cifar, classes).evaluate(*split_genes(cifar, encode(cifar, arch)[None, :]))
    assert int(got.macs[0]) == arch_cost(cifar, arch, classes)[0]


@settings(max_examples=60, deadline=None)
@given(arch=archs(load_preset("fmnist-small")))
def test_fitness_is_finite_and_rho_positive(arch):
    f = evaluate(load_preset("fmnist-small"), arch)
    assert math.isfinite(f.fitness) and f.rho > 0 and f.entropy > 0 and f.feasible
