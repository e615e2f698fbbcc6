"""Measured cost of a static model with forward hooks: the cross-check of the analytic model."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def measure_macs(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Per-example conv + linear multiply-accumulates of one forward pass on a zero input."""
    total = 0

    def conv_hook(module: nn.Conv2d, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        kernel = module.kernel_size[0] * module.kernel_size[1]
        total += output[0].numel() * (module.in_channels // module.groups) * kernel

    def linear_hook(module: nn.Linear, _inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        total += output[0].numel() * module.in_features

    handles = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
    was_training = model.training
    model.eval()
    try:
        model(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return total


def measure_params(model: nn.Module) -> int:
    """Trainable parameter count (BN running statistics are buffers and do not count)."""
    return sum(p.numel() for p in model.parameters())
