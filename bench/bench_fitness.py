"""Scalar vs vectorized fitness throughput (method §3), measured side by side in one run.

    PYTHONPATH=. python3 bench/bench_fitness.py [--preset paper-cifar100] [--n 4000]

The scalar path (``fitness.evaluate``) builds a Layout per architecture; the
vectorized path (``PopulationEvaluator``) scores a whole gene array at once.
A GA generation scores 256 individuals, so that batch size is reported along
with a large batch. Both paths score the same random architectures and the
script checks that they agree before printing the ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from feast_edge.cache.fitness import evaluate, population_evaluator
from feast_edge.cache.search import gene_highs, split_genes
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset


def _per_second(fn, count: int, min_time: float = 0.5) -> float:
    """Evaluations per second of ``fn`` (which scores ``count`` individuals), best of repeated runs."""
    best, spent = float("inf"), 0.0
    while spent < min_time:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return count / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-cifar100")
    parser.add_argument("--n", type=int, default=4000, help="random architectures for the scalar path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    preset = load_preset(args.preset)
    rng = np.random.default_rng(args.seed)
    genes = rng.integers(0, gene_highs(preset), size=(max(args.n, 65536), gene_highs(preset).size))
    d, e, w = split_genes(preset, genes[: args.n])
    arches = [
        Arch(d=tuple(map(int, d[i])), e=tuple(preset.expansion_ratios[j] for j in e[i]), w=tuple(map(int, w[i])))
        for i in range(args.n)
    ]
    evaluator = population_evaluator(preset)

    def scalar() -> list:
        arch_layout.cache_clear()  # no memoised layouts: every architecture is new to a GA
        return [evaluate(preset, a, 300e6, 0.31) for a in arches]

    want = np.array([f.fitness for f in scalar()])
    got = evaluator.evaluate(d, e, w, 300e6, 0.31).fitness
    assert np.allclose(got, want, rtol=1e-12, atol=0), "scalar and vectorized fitness disagree"

    scalar_rate = _per_second(scalar, args.n)
    pop = genes[:256]
    rate_256 = _per_second(lambda: evaluator.evaluate(*split_genes(preset, pop), 300e6, 0.31), len(pop))
    rate_big = _per_second(lambda: evaluator.evaluate(*split_genes(preset, genes), 300e6, 0.31), len(genes))

    print(f"preset {preset.name}: fitness evaluations per second")
    print(f"  scalar (fitness.evaluate, {args.n} archs)      {scalar_rate:14,.0f}")
    print(f"  vectorized, batch 256 (one GA generation)      {rate_256:14,.0f}   {rate_256 / scalar_rate:8.1f}x scalar")
    print(
        f"  vectorized, batch {len(genes):,}                    {rate_big:14,.0f}   {rate_big / scalar_rate:8.1f}x scalar"
    )
    per_target = 256 * 513
    print(
        f"  one cache target (256 x 513 evaluations): scalar {per_target / scalar_rate:.1f} s, vectorized {per_target / rate_256:.2f} s"
    )


if __name__ == "__main__":
    main()
