"""Extraction: one architecture of the supernet as a plain static model (method §1, §8)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from feast_edge.space.arch import Arch
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet
from feast_edge.util.slicing import leading_slice


@torch.no_grad()
def extract(supernet: Supernet, arch: Arch) -> StaticResNet:
    """Copy the leading slices ``arch`` activates into a new StaticResNet (eval mode)."""
    model = StaticResNet(supernet.active_layout(arch))
    source = supernet.state_dict()
    model.load_state_dict(
        {name: leading_slice(source[name], t.shape).clone() for name, t in model.state_dict().items()}
    )
    return model.eval()


@torch.no_grad()
def recalibrate_bn(model: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Reset BN running statistics and re-estimate them as a cumulative average (method §8).

    ``batches`` are (already normalized) input tensors in a fixed order, without
    Mixup/CutMix. Returns the number of samples seen. The model ends in eval mode.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average over all calibration batches
    model.train()
    seen = 0
    try:
        for x in batches:
            model(x)
            seen += x.shape[0]
    finally:
        for m, momentum in zip(norms, saved):
            m.momentum = momentum
        model.eval()
    if seen == 0:
        raise ValueError("BN recalibration needs at least one calibration batch")
    return seen


def extract_calibrated(supernet: Supernet, arch: Arch, batches: Iterable[torch.Tensor]) -> StaticResNet:
    """Extract ``arch`` and give it its own BN statistics; the supernet is not modified."""
    model = extract(supernet, arch)
    recalibrate_bn(model, batches)
    return model
