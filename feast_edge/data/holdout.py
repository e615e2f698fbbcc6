"""A device's held-out split: examples that never train, kept to evaluate on the device's own data.

Two rules. :func:`content_split` (a device's own image folder or manifest, which grows): each image is held out by a
stable function of its content and class alone, so an image never changes sides as the folder grows. :func:`holdout_split`
(shard files, partitions, Fashion-MNIST and CIFAR folders, which do not grow): a per-class draw over positions, exactly
as before, so ``feast-edge simulate`` and the federations that match it stay bit-identical.
"""

from __future__ import annotations

import hashlib
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
    _check(fraction)
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


SALT = b"feast-edge held-out split 1\0"  # changes only with the rule: every device's split changes with it


def content_draws(images: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> np.ndarray:
    """Each example's draw in [0, 1): the first 8 bytes of SHA-256(``SALT``, its class index, its decoded pixels) as a
    fraction of 2**64. A function of the image and its class alone (not of its file name, position or neighbours)."""
    pixels = np.ascontiguousarray(images.cpu().numpy() if isinstance(images, torch.Tensor) else images)
    values = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64).reshape(-1)
    if len(pixels) != len(values):
        raise ValueError(f"content_draws: {len(pixels)} images but {len(values)} labels")
    draws = np.empty(len(values), dtype=np.float64)
    for i, label in enumerate(values.tolist()):
        digest = hashlib.sha256(SALT + str(label).encode() + b"\0")
        digest.update(np.ascontiguousarray(pixels[i]).data)
        draws[i] = int.from_bytes(digest.digest()[:8], "big") / 2.0**64
    return draws


def content_split(
    images: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray, fraction: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train_index, holdout_index)``, sorted int64 positions: an example is held out iff its
    :func:`content_draws` value is below ``fraction`` (in [0, 0.9]).

    Stable as a folder grows: adding, removing or reordering other images never moves an image between the splits.
    Per class of ``n`` examples the held-out count is Binomial(n, fraction): ``fraction * n`` in expectation, with a
    standard deviation of ``sqrt(n * fraction * (1 - fraction))`` (10 ± 3 of 100 at 0.1). A class with one image holds
    it out with probability ``fraction`` (unlike :func:`holdout_split`, which never holds out a class's only example:
    that would move it when a second one arrives). Identical images of one class fall on the same side.
    """
    _check(fraction)
    held = content_draws(images, labels) < float(fraction)
    return torch.from_numpy(np.flatnonzero(~held)), torch.from_numpy(np.flatnonzero(held))


def _check(fraction: float) -> None:
    if not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= MAX_HOLDOUT:
        raise DataError(f"--holdout {fraction!r} must be a fraction between 0 and {MAX_HOLDOUT}, e.g. --holdout 0.1")
