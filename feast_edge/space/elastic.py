"""Elastic layers: standard layers whose forward uses a leading slice of their tensors (method §1).

Input channels are read from the input tensor; output channels are passed in.
The layers hold no "active" state, so one module can serve several
architectures in the same step (co-training) without stale flags.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ElasticConv2d(nn.Conv2d):
    """Bias-free conv whose active weight is ``weight[:out, :x.shape[1]]``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)

    def forward(self, x: torch.Tensor, out_channels: int | None = None) -> torch.Tensor:  # type: ignore[override]
        out = self.out_channels if out_channels is None else out_channels
        weight = self.weight
        if out != weight.shape[0] or x.shape[1] != weight.shape[1]:
            weight = weight[:out, : x.shape[1]]
        return F.conv2d(x, weight, None, self.stride, self.padding)


class ElasticBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over the first ``x.shape[1]`` channels; running stats update in place on that slice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        if c == self.num_features:
            return super().forward(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or self.running_mean is None
        return F.batch_norm(
            x,
            self.running_mean[:c] if self.running_mean is not None else None,
            self.running_var[:c] if self.running_var is not None else None,
            self.weight[:c],
            self.bias[:c],
            use_batch_stats,
            momentum,
            self.eps,
        )


class ElasticLinear(nn.Linear):
    """Classifier over the first ``x.shape[1]`` features; every class is kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if x.shape[1] == self.in_features else self.weight[:, : x.shape[1]]
        return F.linear(x, weight, self.bias)
