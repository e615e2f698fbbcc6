"""Per-target genetic search for the best architecture under a MAC budget (method §3).

Chromosome: ``S`` depth genes (extra blocks), ``S`` expansion-index genes and
``S + 1`` width-index genes (stem first), ``S`` = the preset's stage count.
One generation: tournament selection (size 3), single-point crossover of
consecutive pairs, mutation (probability 0.3 per individual, one random gene
redrawn), elitism (the best-ever individual replaces the worst child).
The paper's "feasibility-preserving initialization and mutation": the initial
population is drawn uniformly and kept only if feasible, and an infeasible
mutant is redrawn (up to ``MUTATION_TRIES`` times, else the child stays as it
was). Crossover children may be infeasible; their sentinel fitness ranks them
below every feasible individual. Every random choice comes from one explicit
``numpy.random.Generator``.

The same search answers post-hoc extraction ("the best architecture under X
MACs", :func:`best_arch_under`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from feast_edge.cache.fitness import OVER_RHO, Fitness, PopulationEvaluator, evaluate, population_evaluator
from feast_edge.errors import FeastError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import Preset

POPULATION = 256  # method §3
GENERATIONS = 512  # method §3
EXTRACTION_POPULATION = 512  # paper supplement F (post-hoc extraction)
TOURNAMENT = 3
MUTATION_PROB = 0.3
MUTATION_TRIES = 10  # redraws before a mutation is given up (feasibility-preserving mutation)
MAX_INITIAL_DRAWS = 1 << 24  # uniform draws before a target is declared infeasible
_DRAW_BATCH = 1 << 13


class SearchError(FeastError, ValueError):
    """A search target cannot be met (no feasible architecture) or its settings are invalid."""


@dataclass(frozen=True)
class SearchResult:
    """Best architecture found for one target, with its fitness terms and the search settings."""

    arch: Arch
    fitness: Fitness
    target: float
    rho0: float
    seed: int
    population: int
    generations: int
    history: tuple[float, ...]  # best-ever fitness after initialisation and after each generation


# ------------------------------------------------------------------ chromosome
def gene_highs(preset: Preset) -> np.ndarray:
    """Exclusive upper bound of every gene: depths, expansion indices, width indices."""
    n = preset.num_stages
    return np.array(
        [preset.max_extra_blocks + 1] * n
        + [len(preset.expansion_ratios)] * n
        + [len(preset.width_multipliers)] * (n + 1),
        dtype=np.int64,
    )


def split_genes(preset: Preset, genes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(d, e_index, w_index)`` views of a ``(P, 3S + 1)`` gene array."""
    n = preset.num_stages
    return genes[:, :n], genes[:, n : 2 * n], genes[:, 2 * n :]


def decode(preset: Preset, genes: np.ndarray) -> Arch:
    """Architecture of one chromosome."""
    d, e, w = split_genes(preset, np.asarray(genes).reshape(1, -1))
    return Arch(
        d=tuple(int(v) for v in d[0]),
        e=tuple(preset.expansion_ratios[int(i)] for i in e[0]),
        w=tuple(int(v) for v in w[0]),
    )


def encode(preset: Preset, arch: Arch) -> np.ndarray:
    """Chromosome of one architecture (validated against ``preset``)."""
    arch = arch.validated(preset)
    e = [preset.expansion_ratios.index(r) for r in arch.e]
    return np.array([*arch.d, *e, *arch.w], dtype=np.int64)


# ------------------------------------------------------------------ GA pieces
def _fitness(evaluator: PopulationEvaluator, genes: np.ndarray, target: float, rho0: float) -> np.ndarray:
    return evaluator.evaluate(*split_genes(evaluator.preset, genes), max_macs=target, rho0=rho0).fitness


def gene_box(evaluator: PopulationEvaluator, target: float) -> np.ndarray:
    """Exclusive per-gene bounds of the smallest box holding every chromosome with MAC ≤ ``target``.

    MACs grow with every gene, so gene ``g`` can take value ``v`` in a feasible
    chromosome only if the chromosome that is minimal except ``g = v`` fits.
    """
    highs = gene_highs(evaluator.preset)
    values = np.arange(highs.max())
    probes = np.zeros((highs.size, values.size, highs.size), dtype=np.int64)
    for g in range(highs.size):
        probes[g, :, g] = np.minimum(values, highs[g] - 1)
    macs = evaluator.evaluate(*split_genes(evaluator.preset, probes.reshape(-1, highs.size))).macs.reshape(
        highs.size, values.size
    )
    return ((macs <= target) & (values[None, :] < highs[:, None])).sum(axis=1)


def initial_population(
    evaluator: PopulationEvaluator,
    target: float,
    rho0: float,
    size: int,
    rng: np.random.Generator,
    max_draws: int = MAX_INITIAL_DRAWS,
) -> np.ndarray:
    """``size`` chromosomes drawn uniformly and kept only if feasible (method §3).

    Draws come from :func:`gene_box`, which holds every feasible chromosome, so
    the kept ones are uniform over the feasible set exactly as with draws from
    the whole space, at a fraction of the draws for tight targets.
    """
    name = evaluator.preset.name
    box = gene_box(evaluator, target)
    if (box == 0).any():
        raise SearchError(
            f"target {target / 1e6:.3f}M MACs is below the smallest architecture of preset {name}; raise the target"
        )
    found: list[np.ndarray] = []
    count = drawn = 0
    while count < size and drawn < max_draws:
        batch = rng.integers(0, box, size=(_DRAW_BATCH, box.size))
        keep = batch[_fitness(evaluator, batch, target, rho0) > OVER_RHO]
        found.append(keep)
        count += len(keep)
        drawn += _DRAW_BATCH
    if count < size:
        raise SearchError(
            f"target {target / 1e6:.3f}M MACs with rho0 = {rho0} of preset {name}: only {count} of {drawn:,} uniformly drawn "
            f"architectures are feasible, the population needs {size}; raise the target or rho0 (preset [cache] section)"
        )
    return np.concatenate(found)[:size]


def tournament(fitness: np.ndarray, rng: np.random.Generator, size: int = TOURNAMENT) -> np.ndarray:
    """Indices of ``len(fitness)`` tournament winners, each the best of ``size`` uniform picks."""
    picks = rng.integers(0, len(fitness), size=(len(fitness), size))
    return picks[np.arange(len(fitness)), np.argmax(fitness[picks], axis=1)]


def crossover(parents: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Single-point crossover of consecutive pairs (0,1), (2,3), …; an odd last parent passes through."""
    pairs = len(parents) // 2
    a, b = parents[0 : 2 * pairs : 2], parents[1 : 2 * pairs : 2]
    points = rng.integers(1, parents.shape[1], size=pairs)
    tail = np.arange(parents.shape[1])[None, :] >= points[:, None]
    children = parents.copy()
    children[0 : 2 * pairs : 2] = np.where(tail, b, a)
    children[1 : 2 * pairs : 2] = np.where(tail, a, b)
    return children


def redraw_one_gene(genes: np.ndarray, highs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Copy of ``genes`` with one uniformly chosen gene per row redrawn uniformly from its range."""
    which = rng.integers(0, genes.shape[1], size=len(genes))
    out = genes.copy()
    out[np.arange(len(genes)), which] = rng.integers(0, highs[which])
    return out


def mutate(
    evaluator: PopulationEvaluator,
    genes: np.ndarray,
    fitness: np.ndarray,
    target: float,
    rho0: float,
    rng: np.random.Generator,
    prob: float = MUTATION_PROB,
    tries: int = MUTATION_TRIES,
) -> tuple[np.ndarray, np.ndarray]:
    """Feasibility-preserving mutation: with probability ``prob`` an individual gets one random gene redrawn.

    Each mutated individual gets ``tries`` independent one-gene redraws and
    keeps the first feasible one; with none feasible it stays as it was.
    (All redraws are evaluated in one vectorized call.) Returns the new genes
    and their fitness.
    """
    genes, fitness = genes.copy(), fitness.copy()
    rows = np.flatnonzero(rng.random(len(genes)) < prob)
    if rows.size == 0:
        return genes, fitness
    candidates = redraw_one_gene(np.repeat(genes[rows], tries, axis=0), gene_highs(evaluator.preset), rng)
    cand_fit = _fitness(evaluator, candidates, target, rho0).reshape(rows.size, tries)
    ok = cand_fit > OVER_RHO
    first = np.argmax(ok, axis=1)  # first feasible redraw of each row
    hit = ok[np.arange(rows.size), first]
    pick = np.arange(rows.size) * tries + first
    genes[rows[hit]] = candidates[pick[hit]]
    fitness[rows[hit]] = cand_fit.reshape(-1)[pick[hit]]
    return genes, fitness


def run_ga(
    evaluator: PopulationEvaluator,
    target: float,
    rho0: float,
    rng: np.random.Generator,
    population: int = POPULATION,
    generations: int = GENERATIONS,
    max_draws: int = MAX_INITIAL_DRAWS,
) -> tuple[np.ndarray, tuple[float, ...]]:
    """Best-ever chromosome of one GA run and the best-ever fitness history (method §3)."""
    if population < 2 or generations < 0:
        raise SearchError(
            f"population = {population} and generations = {generations}: need population >= 2 and generations >= 0"
        )
    pop = initial_population(evaluator, target, rho0, population, rng, max_draws)
    fit = _fitness(evaluator, pop, target, rho0)
    best_i = int(np.argmax(fit))
    best, best_fit = pop[best_i].copy(), float(fit[best_i])
    history = [best_fit]
    for _ in range(generations):
        children = crossover(pop[tournament(fit, rng)], rng)
        pop, fit = mutate(evaluator, children, _fitness(evaluator, children, target, rho0), target, rho0, rng)
        worst = int(np.argmin(fit))
        pop[worst], fit[worst] = best, best_fit
        top = int(np.argmax(fit))
        if fit[top] > best_fit:
            best, best_fit = pop[top].copy(), float(fit[top])
        history.append(best_fit)
    return best, tuple(history)


# ------------------------------------------------------------------ public API
def search_target(
    preset: Preset,
    target: float,
    rho0: float,
    seed: int,
    population: int = POPULATION,
    generations: int = GENERATIONS,
    classes: int | None = None,
) -> SearchResult:
    """Best architecture with MAC ≤ ``target`` and ρ ≤ ``rho0`` found by one seeded GA run (method §3)."""
    evaluator = population_evaluator(preset, classes)
    genes, history = run_ga(evaluator, target, rho0, np.random.default_rng(seed), population, generations)
    arch = decode(preset, genes)
    return SearchResult(
        arch,
        evaluate(preset, arch, target, rho0, classes),
        float(target),
        float(rho0),
        seed,
        population,
        generations,
        history,
    )


def extraction_rho0(preset: Preset, budget: float) -> float:
    """Effectiveness ceiling for a post-hoc extraction budget, from the preset's [cache] data (paper F)."""
    if not preset.extraction_rho:
        raise SearchError(
            f"preset {preset.name} defines no extraction ceilings ([cache] extraction = [...] in its TOML); pass rho0 explicitly"
        )
    return [step.rho0 for step in preset.extraction_rho if step.from_macs <= budget][-1]


def best_arch_under(
    preset: Preset,
    max_macs: float,
    rho0: float | None = None,
    seed: int = 0,
    population: int = EXTRACTION_POPULATION,
    generations: int = GENERATIONS,
    classes: int | None = None,
) -> SearchResult:
    """Post-hoc extraction: the best architecture under ``max_macs`` MACs (method §3, paper supplement F)."""
    floor = arch_cost(preset, Arch.smallest(preset), classes)[0]
    if not math.isfinite(max_macs) or max_macs < floor:
        raise SearchError(
            f"budget {max_macs / 1e6:.3f}M MACs is below the smallest architecture of preset {preset.name} "
            f"({floor / 1e6:.3f}M MACs); raise the budget"
        )
    ceiling = extraction_rho0(preset, max_macs) if rho0 is None else rho0
    return search_target(preset, max_macs, ceiling, seed, population, generations, classes)
