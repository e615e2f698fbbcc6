"""A plain ResNet of one Layout: standard Conv2d/BatchNorm2d/Linear, no elastic code.

This is what a device runs and what is exported to ONNX. Its state-dict names
equal the supernet's, so extraction is a leading-slice copy per tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.space.geometry import Layout


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)


class Stem(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv = conv3x3(in_channels, channels, stride)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class Shortcut(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv = conv1x1(in_channels, channels, stride)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, mid: int, channels: int, stride: int, projection: bool) -> None:
        super().__init__()
        self.conv1 = conv3x3(in_channels, mid, stride)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = conv3x3(mid, channels)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = Shortcut(in_channels, channels, stride) if projection else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + identity)


class StaticResNet(nn.Module):
    """The network one variant computes, as ordinary PyTorch layers."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self.layout = layout
        self.stem = Stem(layout.in_channels, layout.stem_channels, layout.stem_stride)
        self.stages = nn.ModuleList(
            nn.ModuleList(BasicBlock(b.in_channels, b.mid, b.channels, b.stride, b.projection) for b in stage)
            for stage in layout.block_specs()
        )
        self.classifier = nn.Linear(layout.last_channels, layout.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for blocks in self.stages:
            for block in blocks:
                x = block(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


class Normalized(nn.Module):
    """Wraps a model so it takes pixel values in [0, 1] and normalizes them itself."""

    def __init__(self, model: nn.Module, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)
