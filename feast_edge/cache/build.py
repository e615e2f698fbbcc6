"""Building the variant cache A of a preset: one GA search per MAC target, merged into one entry per network (method §3).

``feast-edge cache build`` calls :func:`build_cache`; :mod:`feast_edge.cache.variants` holds the cache it returns and
how it is stored, found and loaded.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from feast_edge.cache.fitness import evaluate
from feast_edge.cache.search import (
    GENERATIONS,
    MUTATION_PROB,
    MUTATION_TRIES,
    POPULATION,
    TOURNAMENT,
    SearchResult,
    search_target,
)
from feast_edge.cache.variants import (
    DEFAULT_SEED,
    CacheEntry,
    CacheError,
    ProgressFn,
    SearchJob,
    VariantCache,
    _fail,
    _job_order,
    one_per_network,
)
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import Preset


def cache_targets(preset: Preset) -> tuple[tuple[float, float], ...]:
    """``(target MACs, rho0)`` of every segment in the preset's [cache] data, merged and sorted (method §3)."""
    if not preset.cache_segments:
        raise CacheError(
            f"preset {preset.name} defines no cache targets; add a [cache] section with segments "
            "(see feast_edge/presets/paper-cifar100.toml) or pass targets explicitly"
        )
    pairs = [(t, seg.rho0) for seg in preset.cache_segments for t in seg.targets]
    return tuple(sorted(pairs, key=lambda pair: pair[0]))


def cache_jobs(targets: Sequence[tuple[float, float]], seed: int) -> tuple[SearchJob, ...]:
    """One job per target, sorted by target; job ``k`` runs with seed ``seed + k``."""
    ordered = sorted(targets, key=lambda pair: pair[0])
    return tuple(SearchJob(float(t), float(r), seed + k) for k, (t, r) in enumerate(ordered))


def merge_entries(preset: Preset, found: Sequence[tuple[SearchJob, Arch]], classes: int) -> tuple[CacheEntry, ...]:
    """MAC-sorted cache entries, one per distinct network, each listing every job that found it."""
    jobs_of: dict[Arch, list[SearchJob]] = {}
    for job, arch in found:
        jobs_of.setdefault(arch.validated(preset), []).append(job)
    entries = []
    for arch, jobs in jobs_of.items():
        fit = evaluate(preset, arch, classes=classes)
        params = arch_cost(preset, arch, classes)[1]
        ordered = tuple(sorted(jobs, key=_job_order))
        entries.append(CacheEntry(arch, fit.macs, params, fit.fitness, fit.rho, fit.entropy, ordered))
    return tuple(sorted(one_per_network(preset, entries, classes), key=lambda e: (e.macs, e.arch.text)))


def _run_job(preset: Preset, job: SearchJob, population: int, generations: int, classes: int) -> SearchResult:
    return search_target(preset, job.target, job.rho0, job.seed, population, generations, classes)


def build_cache(
    preset: Preset,
    targets: Sequence[tuple[float, float]] | None = None,
    seed: int = DEFAULT_SEED,
    population: int = POPULATION,
    generations: int = GENERATIONS,
    classes: int | None = None,
    progress: ProgressFn | None = None,
    workers: int = 1,
) -> VariantCache:
    """Search every ``(target, rho0)`` (default: the preset's [cache] targets) and assemble the cache (method §3).

    Each target runs its own GA seeded with ``seed + k`` (``k``: its rank by
    target), so the result does not depend on ``workers``. ``progress(done,
    total, result)`` is called as targets finish.
    """
    classes = preset.classes if classes is None else classes
    jobs = cache_jobs(cache_targets(preset) if targets is None else targets, seed)
    if not jobs:
        raise CacheError(f"no cache targets given for preset {preset.name}; pass at least one (target MACs, rho0) pair")
    results: dict[int, SearchResult] = {}

    def record(k: int, result: SearchResult) -> None:
        results[k] = result
        if progress is not None:
            progress(len(results), len(jobs), result)

    if workers <= 1:
        for k, job in enumerate(jobs):
            record(k, _run_job(preset, job, population, generations, classes))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {
                pool.submit(_run_job, preset, job, population, generations, classes): k for k, job in enumerate(jobs)
            }
            for future in as_completed(futures):
                record(futures[future], future.result())
    entries = merge_entries(preset, [(job, results[k].arch) for k, job in enumerate(jobs)], classes)
    search = {
        "seed": seed,
        "population": population,
        "generations": generations,
        "tournament": TOURNAMENT,
        "mutation_prob": MUTATION_PROB,
        "mutation_tries": MUTATION_TRIES,
    }
    return VariantCache(preset.name, preset.digest, classes, entries, search)


def read_reference_csv(path: str | os.PathLike[str], preset: Preset, classes: int = 10) -> VariantCache:
    """The paper's published cache CSV (``reference/feast-cifar100-cache.csv``, 10-class MACs, method §2).

    The CSV does not record ρ0; each job's ceiling is that of the preset's
    [cache] segment containing its target.
    """
    ceilings = cache_targets(preset)
    found: list[tuple[SearchJob, Arch]] = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            try:
                arch = Arch(d=json.loads(row["d"]), e=json.loads(row["e"]), w=json.loads(row["w_indices"])).validated(
                    preset
                )
                target, seed = float(row["job_target_macs"]), int(row["job_seed"])
            except (KeyError, TypeError, ValueError) as exc:
                raise _fail(
                    f"{path} row {i + 2}",
                    f"is malformed ({type(exc).__name__}: {exc})",
                    "pass the published CSV unchanged",
                ) from None
            rho0 = [r for t, r in ceilings if math.isclose(t, target, rel_tol=1e-9)]
            if not rho0:
                raise _fail(
                    f"{path} row {i + 2}",
                    f"target {target:g} is not a cache target of preset {preset.name}",
                    "pass the CSV of this preset",
                )
            found.append((SearchJob(target, rho0[0], seed), arch))
    return VariantCache(
        preset.name, preset.digest, classes, merge_entries(preset, found, classes), {"source": Path(path).name}
    )
