"""Post-hoc extraction evaluated: uncached variants between the cached operating points, against the cached curve.

After federation the supernet serves architectures it never trained as such
(paper, Sec. 4 and Supplement E): a training-free search (method §3's fitness,
:func:`feast_edge.cache.search.best_arch_under`, what ``feast-edge extract``
runs) picks the best architecture under each of N MAC targets, its weights are
the supernet's leading slices, its BN statistics are recalibrated on the run's
calibration split (method §8), and it is tested on the run's test split. Its gap
is its accuracy minus the cached-variant curve *linearly interpolated at its
realized MACs*; the paper reports the mean absolute gap (CIFAR-100: 1.14 points
over 25–52M MACs, 14 searched architectures). An architecture the search returns
that is itself cached is listed but left out of the mean: it is not post-hoc.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from feast_edge.cache.search import best_arch_under
from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.evaluation import accuracy, calibrated_variant
from feast_edge.space.cost import arch_cost
from feast_edge.space.supernet import Supernet


@dataclass(frozen=True)
class Extracted:
    """One searched architecture: its target, realized cost, test accuracy and gap to the cached curve (points)."""

    target_macs: float
    arch: dict
    macs: int
    params: int
    accuracy: float
    curve: float  # the cached curve at ``macs`` (linear interpolation)
    cached: bool  # the search returned a cached architecture (not post-hoc; left out of the mean gap)

    @property
    def gap(self) -> float:
        return 100 * (self.accuracy - self.curve)

    def to_dict(self) -> dict:
        return {**asdict(self), "gap": self.gap}


def curve_at(macs: float, cached: Sequence[tuple[int, float]]) -> float:
    """The cached variants' accuracy curve, linearly interpolated at ``macs`` (held at its end values outside)."""
    xs, ys = zip(*sorted(cached))
    return float(np.interp(macs, xs, ys))


def target_budgets(low: float, high: float, n: int) -> list[float]:
    """``n`` MAC targets evenly spaced over ``[low, high]`` (the ends included)."""
    if n < 1 or not 0 < low <= high:
        raise ValueError(f"need n >= 1 targets over a range 0 < low <= high, got {n} over {low:g}–{high:g}")
    return [float(v) for v in np.linspace(low, high, n)] if n > 1 else [float(low)]


def extraction_gaps(
    supernet: Supernet,
    cache: VariantCache,
    cached_accuracy: Sequence[float],
    targets: Sequence[float],
    calibration_images: torch.Tensor,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    seed: int = 0,
    population: int = 64,
    generations: int = 64,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> list[Extracted]:
    """Search, extract, recalibrate and test the best architecture under each target (see the module docstring)."""
    preset, classes = supernet.preset, supernet.classes
    curve = [(e.macs, a) for e, a in zip(cache.entries, cached_accuracy)]
    cached_archs = {e.arch for e in cache.entries}
    found = []
    for i, target in enumerate(targets):
        result = best_arch_under(
            preset, target, seed=seed, population=population, generations=generations, classes=classes
        )
        macs, params = arch_cost(preset, result.arch, classes)
        network = calibrated_variant(supernet, result.arch, calibration_images, device=device)
        acc = accuracy(network, images, labels, preset, device=device)
        found.append(
            Extracted(
                target, result.arch.to_dict(), macs, params, acc, curve_at(macs, curve), result.arch in cached_archs
            )
        )
        if progress is not None:
            progress(i + 1, len(targets))
    return found


def mean_abs_gap(found: Sequence[Extracted]) -> float | None:
    """Mean |gap| in points over the uncached architectures (None when the search found only cached ones)."""
    gaps = [abs(e.gap) for e in found if not e.cached]
    return statistics.fmean(gaps) if gaps else None
