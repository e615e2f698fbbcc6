"""A device's held-out split: examples that never train, kept to evaluate on the device's own data."""

from __future__ import annotations

import math

import numpy as np
import torch

from feast_edge.data.images import DataError

MAX_HOLDOUT = 0.9


def holdout_split(
    labels: torch.Tensor | np.ndarray, fraction: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train_index, holdout_index)``, sorted int64 positions into ``labels``, split per class.

    Each class with ``n >= 2`` examples holds out ``round(fraction * n)`` of them,
    at least one and at most ``n - 1``; a class with one example keeps it for
    training. Which examples is drawn per class from ``numpy.random.default_rng([seed, label])``,
    so the split is deterministic and one class's draw does not depend on the
    others. ``fraction`` 0 holds out nothing; it must be in [0, 0.9].
    """
    if not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= MAX_HOLDOUT:
        raise DataError(f"--holdout {fraction!r} must be a fraction between 0 and {MAX_HOLDOUT}, e.g. --holdout 0.1")
    values = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64).reshape(-1)
    held = np.zeros(len(values), dtype=bool)
    if fraction > 0:
        for label in np.unique(values):
            where = np.flatnonzero(values == label)
            n = len(where)
            if n < 2:
                continue
            k = min(n - 1, max(1, math.floor(fraction * n + 0.5)))
            chosen = np.random.default_rng([seed, int(label)]).choice(n, size=k, replace=False)
            held[where[chosen]] = True
    return torch.from_numpy(np.flatnonzero(~held)), torch.from_numpy(np.flatnonzero(held))
