"""Mini-batches of local training: shuffled, augmented where the model trains, from seeded generators.

Every method of the harness trains on :func:`training_batches`, so all of them see the same recipe
(policy, batch size, epochs) and the same draws for the same seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from feast_edge.local.augment import BatchAugmenter, MixedBatch, plain_batch
from feast_edge.local.precision import to_device

if TYPE_CHECKING:
    from collections.abc import Iterator

    from feast_edge.local.recipe import TrainConfig


def _batches(n: int, batch_size: int, generator: torch.Generator, bn_needs_two: bool) -> list[torch.Tensor]:
    """Shuffled index batches of one epoch; the last partial batch is kept.

    The only batch ever dropped is a final batch of a single sample when the
    network's last feature map is 1×1: train-mode BatchNorm cannot normalize
    one value per channel and raises.
    """
    order = torch.randperm(n, generator=generator)
    batches = list(order.split(batch_size))
    if bn_needs_two and len(batches[-1]) == 1:
        batches.pop()
    return batches


def training_batches(
    images_uint8: torch.Tensor,
    labels: torch.Tensor,
    preset,
    classes: int,
    config: TrainConfig,
    shuffle_gen: torch.Generator,
    augment_gen: torch.Generator,
    device: str | torch.device = "cpu",
    bn_needs_two: bool = False,
) -> Iterator[MixedBatch]:
    """The augmented mini-batches of ``config.epochs`` local epochs over uint8 ``images_uint8``, made on ``device``.

    Shuffling draws from ``shuffle_gen``, augmentation from ``augment_gen``; every method of the harness
    trains on these batches, so they all see the same recipe (policy, batch size, epochs). On a GPU the
    uint8 shard is copied there once (pinned, non-blocking) and every batch is augmented on the GPU.
    """
    augmenter = BatchAugmenter(
        preset.mean,
        preset.std,
        classes,
        config.randaugment,
        config.mixup_alpha,
        config.cutmix_alpha,
        config.augment,
        config.crop_padding,
    )
    device = torch.device(device)
    images_uint8, labels = to_device(images_uint8, device), to_device(labels, device)
    count = 0
    for _ in range(config.epochs):
        for index in _batches(len(labels), config.batch_size, shuffle_gen, bn_needs_two):
            index = to_device(index, device)
            if config.augment != "none":
                yield augmenter(images_uint8[index], labels[index], count, augment_gen)
            else:
                yield plain_batch(images_uint8[index], labels[index], preset.mean, preset.std, classes)
            count += 1


def seeds(seed: int, count: int) -> list[int]:
    """Independent sub-seeds, so shuffling, augmentation and ``a_rand`` draws do not shift each other across ablations."""
    return [int(s.generate_state(1, np.uint64)[0] >> 1) for s in np.random.SeedSequence(seed).spawn(count)]
