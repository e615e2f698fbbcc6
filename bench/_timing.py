"""Timing helpers for the bench scripts: interleaved repetitions, median seconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, alternating A, B, A, B ... so drift hits both alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}
