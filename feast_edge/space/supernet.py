"""The elastic supernet: one ResNet whose leading slices are every variant (method §1).

``Supernet(preset)`` holds the full physical tensors; ``Supernet(preset,
layout=envelope)`` holds a smaller physical sub-supernet with the same tensor
names (a routed envelope, method §5). ``model(x, arch)`` runs the variant
``arch``; nothing about the active variant is stored on the modules.

State-dict names are shared with :class:`feast_edge.space.static.StaticResNet`, so a
local tensor always maps to the leading slice of the global tensor of the same
name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.errors import ArchError
from feast_edge.space.arch import Arch
from feast_edge.space.elastic import ElasticBatchNorm2d, ElasticConv2d, ElasticLinear
from feast_edge.space.geometry import Layout, arch_layout, supernet_layout
from feast_edge.space.preset import Preset


class ElasticStem(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv = ElasticConv2d(in_channels, channels, 3, stride)
        self.bn = ElasticBatchNorm2d(channels)

    def forward(self, x: torch.Tensor, channels: int) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x, channels)))


class ElasticShortcut(nn.Module):
    """Block-0 projection: 1x1 conv with the block's stride, then BN."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv = ElasticConv2d(in_channels, channels, 1, stride)
        self.bn = ElasticBatchNorm2d(channels)

    def forward(self, x: torch.Tensor, channels: int) -> torch.Tensor:
        return self.bn(self.conv(x, channels))


class ElasticBlock(nn.Module):
    """Two 3x3 convs ``in -> mid -> out``; projection shortcut in block 0, identity elsewhere."""

    def __init__(self, in_channels: int, mid: int, channels: int, stride: int, projection: bool) -> None:
        super().__init__()
        self.conv1 = ElasticConv2d(in_channels, mid, 3, stride)
        self.bn1 = ElasticBatchNorm2d(mid)
        self.conv2 = ElasticConv2d(mid, channels, 3)
        self.bn2 = ElasticBatchNorm2d(channels)
        self.shortcut = ElasticShortcut(in_channels, channels, stride) if projection else None

    def forward(self, x: torch.Tensor, mid: int, channels: int) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x, mid)))
        out = self.bn2(self.conv2(out, channels))
        identity = x if self.shortcut is None else self.shortcut(x, channels)
        return F.relu(out + identity)


class Supernet(nn.Module):
    """Elastic ResNet of one preset; ``forward(x, arch)`` activates the leading slices of ``arch``."""

    def __init__(
        self,
        preset: Preset,
        classes: int | None = None,
        layout: Layout | None = None,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        self.preset = preset
        self.layout = supernet_layout(preset, classes) if layout is None else layout
        self.classes = self.layout.classes
        lay = self.layout
        self.stem = ElasticStem(lay.in_channels, lay.stem_channels, lay.stem_stride)
        self.stages = nn.ModuleList(
            nn.ModuleList(ElasticBlock(b.in_channels, b.mid, b.channels, b.stride, b.projection) for b in stage)
            for stage in lay.block_specs()
        )
        self.classifier = ElasticLinear(lay.last_channels, lay.classes)
        if seed is not None:
            init_weights(self, torch.Generator().manual_seed(seed))

    def active_layout(self, arch: Arch) -> Layout:
        """Geometry of ``arch``; raises ArchError if it does not fit this (sub-)supernet."""
        layout = arch_layout(self.preset, arch, self.classes)
        if not layout.fits_in(self.layout):
            raise ArchError(
                f"arch {arch} does not fit this supernet (it needs wider or deeper tensors than were routed); "
                "use an arch from this client's affordable set"
            )
        return layout

    def forward(self, x: torch.Tensor, arch: Arch) -> torch.Tensor:
        act = self.active_layout(arch)
        x = self.stem(x, act.stem_channels)
        for stage, blocks in zip(act.stages, self.stages):
            for block in blocks[: stage.blocks]:
                x = block(x, stage.mid, stage.channels)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x)


def init_weights(model: nn.Module, generator: torch.Generator) -> None:
    """Kaiming-normal convs, unit BN, uniform classifier, all from one seeded generator."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu", generator=generator)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            bound = 1.0 / m.in_features**0.5
            nn.init.uniform_(m.weight, -bound, bound, generator=generator)
            nn.init.uniform_(m.bias, -bound, bound, generator=generator)


def state_shapes(preset: Preset, layout: Layout) -> dict[str, tuple[int, ...]]:
    """State-dict names and shapes of a (sub-)supernet of ``layout``, without allocating it."""
    return dict(_state_shapes(preset, layout))


@functools.lru_cache(maxsize=512)
def _state_shapes(preset: Preset, layout: Layout) -> tuple[tuple[str, tuple[int, ...]], ...]:
    # Building the module on the meta device takes milliseconds; every payload encoded or decoded asks for its envelope's
    # shapes, and a fleet shares a few envelopes, so a server routing hundreds of devices a round asks the same few times.
    with torch.device("meta"):
        model = Supernet(preset, layout=layout, seed=None)
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())
