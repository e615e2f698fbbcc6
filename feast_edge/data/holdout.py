"""A device's held-out split: examples that never train, kept to evaluate on the device's own data.

Two rules. :func:`content_split` (a device's own image folder or manifest, which grows): each image is held out by a
stable function of its content and class alone, so an image never changes sides as the folder grows. :func:`holdout_split`
(shard files, partitions, Fashion-MNIST and CIFAR folders, which do not grow): a per-class draw over positions, exactly
as before, so ``feast-edge simulate`` and the federations that match it stay bit-identical.

A test split (``feast-agent run --test-split``) is cut the same two ways, after the held-out split and apart from it:
:func:`content_bands` puts an image in it when its draw falls in ``[holdout, holdout + test)`` (the band above the
held-out one, so a growing folder never moves an image between the three), and a positional source draws it per class
from the examples left for training, with its own seed (``TEST_SEED``). Without a test split nothing changes.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from feast_edge.data.images import DataError

MAX_HOLDOUT = 0.9
TEST_SEED = 0x7E57  # the per-class draw of a positional source's test split (the held-out draw's seed is 0)


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


def content_bands(
    images: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray, holdout: float, test: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_index, holdout_index, test_index)``, sorted int64 positions: an example is held out iff its
    :func:`content_draws` value is below ``holdout`` (exactly :func:`content_split`), in the test split iff it is in
    ``[holdout, holdout + test)``; stable as a folder grows, like :func:`content_split`."""
    check_splits(holdout, test)
    draws = content_draws(images, labels)
    held, tested = draws < float(holdout), (draws >= float(holdout)) & (draws < float(holdout) + float(test))
    train = ~(held | tested)
    return tuple(torch.from_numpy(np.flatnonzero(m)) for m in (train, held, tested))  # type: ignore[return-value]


def check_splits(holdout: float, test: float) -> None:
    """Both shares valid, and enough left to train on (their sum at most MAX_HOLDOUT)."""
    _check(holdout)
    if not isinstance(test, (int, float)) or not 0.0 <= float(test) <= MAX_HOLDOUT:
        raise DataError(f"--test-split {test!r} must be a fraction between 0 and {MAX_HOLDOUT}, e.g. --test-split 0.1")
    if float(holdout) + float(test) > MAX_HOLDOUT + 1e-12:
        raise DataError(
            f"--holdout {holdout:g} and --test-split {test:g} leave {100 * (1 - holdout - test):.0f}% of the examples "
            f"to train on; keep their sum at most {MAX_HOLDOUT}"
        )


def _check(fraction: float) -> None:
    if not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= MAX_HOLDOUT:
        raise DataError(f"--holdout {fraction!r} must be a fraction between 0 and {MAX_HOLDOUT}, e.g. --holdout 0.1")
