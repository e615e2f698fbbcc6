"""A small served model with real accuracy, made once per test module: fmnist-tiny's smallest cached variant trained
two epochs on 1,200 balanced Fashion-MNIST training images (seeded)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet
from strategies import FMNIST_TINY

PRESET = load_preset(str(FMNIST_TINY))
ARCH = load_cache(PRESET).entries[0].arch


def trained_smallest(split) -> StaticResNet:
    """The smallest variant after two epochs of SGD on ``split``'s first 1,200 images (train mode on return)."""
    torch.manual_seed(0)
    model = StaticResNet(arch_layout(PRESET, ARCH))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(2):
        for x, y in zip(pixel_batches(split.images[:1200], PRESET, 32), split.labels[:1200].long().split(32)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model
