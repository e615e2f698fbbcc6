"""HeteroFL's ResNet-18 (Diao et al., ICLR 2021, ``src/models/resnet.py``) at any width ratio ``r``; ScaleFL may reuse it.

The network, as the original code builds it (pre-activation basic blocks)::

    stem    3×3 conv in_channels → c_0, stride = the preset's stem stride, no BN after it, no max-pool
    stage s (4 stages, widths hidden[s], strides 1, 2, 2, 2; ``blocks[s]`` blocks, 2 for ResNet-18), each block:
            a   = ReLU(BN1(scaler(x)))
            out = conv3x3(a, stride) ; out = conv3x3(ReLU(BN2(scaler(out))))
            y   = out + (conv1x1(a, stride) if stride ≠ 1 or the width changes else x)
    head    ReLU(BN(scaler(x))) → global average pool → Linear(c_last → classes, with bias)

Every conv is bias-free. :class:`Scaler` divides by ``r`` in training only
(identity in eval mode); it sits before every BatchNorm, i.e. right after each
conv output (and residual sum) that a BN normalizes, where the original puts it.
BatchNorm has ``momentum=None``; ``track_running_stats=False`` (the default
here, HeteroFL's "static BN") keeps no running statistics, so training and the
global model carry only weights and biases.

Width ratio ``r`` builds the *physical* top-left-sliced network: every hidden
width ``c`` becomes ``ceil(r·c)``; the image input channels and the classes
never shrink. Its tensors have the global model's names and the leading-slice
shapes ``[:ceil(r·out), :ceil(r·in)]`` (convs), ``[:, :ceil(r·in)]`` (the
classifier weight), ``[:ceil(r·n)]`` (BN), so :func:`leading_state` cuts a
ratio-``r`` payload from a ratio-1 state dict and method §6's leading-slice
aggregation folds it back. :func:`resnet_cost` is the analytic MAC/parameter
count (method §2's rules: conv + linear MACs; conv weights, BN weight + bias,
linear weight + bias).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.util.slicing import leading_slice

STAGE_STRIDES = (1, 2, 2, 2)
BASE_HIDDEN = (64, 128, 256, 512)  # ResNet-18's widths, the HeteroFL paper's CIFAR model


@dataclass(frozen=True)
class ResNetShape:
    """Geometry of the full-width (ratio 1) network: input, classes, stage widths, stem stride, blocks per stage."""

    in_channels: int
    input_size: int
    classes: int
    hidden: tuple[int, ...] = BASE_HIDDEN
    stem_stride: int = 1
    blocks: tuple[int, ...] = (2, 2, 2, 2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(c) for c in self.hidden))
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        if len(self.hidden) != len(STAGE_STRIDES) or len(self.blocks) != len(STAGE_STRIDES):
            raise ValueError(
                f"a ResNet-18-style network has {len(STAGE_STRIDES)} stages; got hidden {self.hidden} and blocks {self.blocks}"
            )
        if (
            min(self.hidden) < 1
            or min(self.blocks) < 1
            or min(self.in_channels, self.input_size, self.classes, self.stem_stride) < 1
        ):
            raise ValueError(f"every width, block count, input size, class count and stride must be >= 1: {self}")

    def widths(self, ratio: float = 1.0) -> tuple[int, ...]:
        """Stage widths of the ratio-``r`` network: ``ceil(r·c)``."""
        return tuple(scaled(c, ratio) for c in self.hidden)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "hidden": list(self.hidden),
            "blocks": list(self.blocks),
            "stage_strides": list(STAGE_STRIDES),
        }


def scaled(channels: int, ratio: float) -> int:
    """``ceil(r·c)`` (rounded to 1e-9 first, so 0.1·30 is 3, not 4), at least 1."""
    if not 0 < ratio <= 1:
        raise ValueError(f"width ratio {ratio} must be in (0, 1]")
    return max(1, math.ceil(round(ratio * channels, 9)))


def out_size(size: int, stride: int) -> int:
    """Output side of a 3×3/pad-1 or 1×1/pad-0 conv with ``stride``: ``ceil(size / stride)``."""
    return (size - 1) // stride + 1


def last_side(shape: ResNetShape) -> int:
    """Side of the last stage's feature map (1 means train-mode BN cannot take a batch of one)."""
    side = out_size(shape.input_size, shape.stem_stride)
    for stride in STAGE_STRIDES:
        side = out_size(side, stride)
    return side


class Scaler(nn.Module):
    """HeteroFL's parameter-free scaler: ``x / rate`` in training mode, the identity in eval mode."""

    def __init__(self, rate: float = 1.0) -> None:
        super().__init__()
        self.rate = float(rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if self.training and self.rate != 1.0 else x

    def extra_repr(self) -> str:
        return f"rate={self.rate}"


def _norm(channels: int, track: bool) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, momentum=None, track_running_stats=track)


class Block(nn.Module):
    """Pre-activation basic block (two 3×3 convs) of the original HeteroFL ResNet."""

    def __init__(self, in_channels: int, channels: int, stride: int, rate: float, track: bool) -> None:
        super().__init__()
        self.scaler = Scaler(rate)
        self.bn1 = _norm(in_channels, track)
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(channels, track)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=1, padding=1, bias=False)
        projects = stride != 1 or in_channels != channels
        self.shortcut = nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False) if projects else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(self.scaler(x)))
        shortcut = x if self.shortcut is None else self.shortcut(a)
        out = self.conv1(a)
        out = self.conv2(F.relu(self.bn2(self.scaler(out))))
        return out + shortcut


class ResNet18(nn.Module):
    """The ratio-``r`` network of ``shape`` (see the module docstring).

    Args:
        shape: the full-width geometry.
        ratio: width ratio ``r`` in (0, 1]; every hidden width becomes ``ceil(r·c)``.
        scale: divide by ``r`` before every BN in training (HeteroFL's Scaler); ``False``: rate 1.
        track_running_stats: keep BN running statistics (for evaluation after recalibration); HeteroFL trains without.
    """

    def __init__(
        self, shape: ResNetShape, ratio: float = 1.0, scale: bool = True, track_running_stats: bool = False
    ) -> None:
        super().__init__()
        self.shape = shape
        self.ratio = float(ratio)
        rate = self.ratio if scale else 1.0
        widths = shape.widths(ratio)
        self.stem = nn.Conv2d(shape.in_channels, widths[0], 3, stride=shape.stem_stride, padding=1, bias=False)
        stages, c_in = [], widths[0]
        for c, n, stride in zip(widths, shape.blocks, STAGE_STRIDES):
            stages.append(
                nn.Sequential(
                    *(
                        Block(c_in if i == 0 else c, c, stride if i == 0 else 1, rate, track_running_stats)
                        for i in range(n)
                    )
                )
            )
            c_in = c
        self.stages = nn.ModuleList(stages)
        self.scaler = Scaler(rate)
        self.norm = _norm(c_in, track_running_stats)
        self.classifier = nn.Linear(c_in, shape.classes)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final BN + ReLU, global average pool, classifier."""
        x = F.relu(self.norm(self.scaler(x)))
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def init_heterofl(model: nn.Module) -> None:
    """The original's ``init_param`` on top of PyTorch's default init: unit BN weight, zero BN and classifier bias."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)


def resnet_cost(shape: ResNetShape, ratio: float = 1.0) -> tuple[int, int]:
    """Analytic ``(MACs, params)`` of the ratio-``r`` network (conv + linear MACs; conv, BN affine and linear params)."""
    widths = shape.widths(ratio)
    side = out_size(shape.input_size, shape.stem_stride)
    c_in = widths[0]
    macs = shape.in_channels * c_in * 9 * side**2
    params = shape.in_channels * c_in * 9
    for c, n, stride in zip(widths, shape.blocks, STAGE_STRIDES):
        for i in range(n):
            s = stride if i == 0 else 1
            side = out_size(side, s)
            area = side**2
            macs += (c_in * c + c * c) * 9 * area
            params += 2 * c_in + c_in * c * 9 + 2 * c + c * c * 9  # bn1, conv1, bn2, conv2
            if s != 1 or c_in != c:
                macs += c_in * c * area
                params += c_in * c
            c_in = c
    macs += c_in * shape.classes
    params += 2 * c_in + c_in * shape.classes + shape.classes  # final BN, classifier
    return macs, params


def hidden_for_budget(
    in_channels: int, input_size: int, classes: int, stem_stride: int, budget: float, divisor: int = 8
) -> tuple[int, ...]:
    """ResNet-18 widths ``(w, 2w, 4w, 8w)`` with ``w`` the largest multiple of ``divisor`` whose full network fits ``budget`` MACs.

    ``w = 64·k`` with ``k ≈ sqrt(budget / MACs(64, 128, 256, 512))`` (MACs grow with the square of the width),
    rounded down to the divisor; at least ``divisor``. On paper-cifar100 (32×32, 600M cap) this is (64, 128, 256, 512).
    """

    def macs(w: int) -> int:
        hidden = tuple(w * BASE_HIDDEN[i] // BASE_HIDDEN[0] for i in range(len(BASE_HIDDEN)))
        return resnet_cost(ResNetShape(in_channels, input_size, classes, hidden, stem_stride))[0]

    w = divisor
    while macs(w + divisor) <= budget:
        w += divisor
    return tuple(w * c // BASE_HIDDEN[0] for c in BASE_HIDDEN)


def tensor_shapes(shape: ResNetShape, ratio: float = 1.0) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the ratio-``r`` network (no running statistics), without allocating it."""
    with torch.device("meta"):
        model = ResNet18(shape, ratio)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def leading_state(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Copies of the top-left slices ``state[name][:s0, :s1, ...]`` for every ``name -> shape`` in ``shapes``."""
    return {name: leading_slice(state[name].detach(), s).clone() for name, s in shapes.items()}


def build_network(
    shape: ResNetShape,
    ratio: float,
    state: Mapping[str, torch.Tensor],
    scale: bool = True,
    track_running_stats: bool = False,
    device: str | torch.device = "cpu",
) -> ResNet18:
    """The ratio-``r`` network holding the top-left slices of ``state`` (a ratio-1 state dict, or exactly its slices).

    No random draw: the network is built on the meta device and every parameter is copied from ``state``;
    BN running statistics, when tracked, start reset (recalibrate them before evaluating).
    """
    with torch.device("meta"):
        model = ResNet18(shape, ratio, scale=scale, track_running_stats=track_running_stats)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(leading_slice(state[name].detach(), tuple(p.shape)))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d) and m.track_running_stats:
            m.reset_running_stats()
    return model
