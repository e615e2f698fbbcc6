"""Resolved layer geometry of an architecture or of a (sub-)supernet (method §1).

A :class:`Layout` lists the concrete channel counts, block counts, strides and
resolutions of a network of the family. The same type describes three things:

* an *active* architecture (``arch_layout``): what one variant computes;
* the *full supernet* (``supernet_layout``): the physical tensors the server holds;
* a *routed envelope* (issue: routing): the physical tensors one client receives.

Cost, fitness, supernet construction and extraction all read a Layout, so the
channel arithmetic lives here only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset


def make_divisible(v: float, divisor: int = 8) -> int:
    """Round ``v`` to a multiple of ``divisor`` (at least ``divisor``), never more than 10 % down."""
    n = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if n < 0.9 * v:
        n += divisor
    return n


@dataclass(frozen=True)
class StageLayout:
    """One stage: ``blocks`` residual blocks, block 0 carries the stride and the projection."""

    blocks: int
    in_channels: int
    channels: int
    mid: int
    stride: int
    resolution: int  # output resolution (square)


@dataclass(frozen=True)
class BlockSpec:
    """Constructor arguments of one residual block."""

    in_channels: int
    mid: int
    channels: int
    stride: int
    projection: bool


@dataclass(frozen=True)
class Layout:
    """Concrete geometry of a network of the family (active variant or physical supernet)."""

    in_channels: int
    input_size: int
    stem_channels: int
    stem_stride: int
    stem_resolution: int
    stages: tuple[StageLayout, ...]
    classes: int

    @property
    def last_channels(self) -> int:
        return self.stages[-1].channels

    def fits_in(self, other: "Layout") -> bool:
        """True when every dimension of ``self`` is a leading slice of ``other``."""
        if (self.in_channels, self.input_size, self.stem_stride, self.classes) != (
            other.in_channels,
            other.input_size,
            other.stem_stride,
            other.classes,
        ) or len(self.stages) != len(other.stages):
            return False
        if self.stem_channels > other.stem_channels:
            return False
        return all(
            a.blocks <= b.blocks and a.channels <= b.channels and a.mid <= b.mid and a.stride == b.stride
            for a, b in zip(self.stages, other.stages)
        )

    def block_specs(self) -> list[list[BlockSpec]]:
        """Per stage, the blocks to build: block 0 strides and projects, the rest keep shape."""
        return [
            [
                BlockSpec(s.in_channels if b == 0 else s.channels, s.mid, s.channels, s.stride if b == 0 else 1, b == 0)
                for b in range(s.blocks)
            ]
            for s in self.stages
        ]

    def summary_rows(self) -> list[tuple[str, int, int, int, int]]:
        """Rows ``(part, blocks, channels, mid, resolution)`` for tables."""
        rows = [("stem", 1, self.stem_channels, 0, self.stem_resolution)]
        for i, s in enumerate(self.stages):
            rows.append((f"stage {i + 1}", s.blocks, s.channels, s.mid, s.resolution))
        return rows


def _build(
    preset: Preset,
    classes: int,
    stem_channels: int,
    blocks: tuple[int, ...],
    channels: tuple[int, ...],
    mids: tuple[int, ...],
) -> Layout:
    resolution = math.ceil(preset.input_size / preset.stem_stride)
    stem_resolution = resolution
    stages = []
    c_in = stem_channels
    for s in range(preset.num_stages):
        resolution = math.ceil(resolution / preset.stage_strides[s])
        stages.append(StageLayout(blocks[s], c_in, channels[s], mids[s], preset.stage_strides[s], resolution))
        c_in = channels[s]
    return Layout(
        in_channels=preset.in_channels,
        input_size=preset.input_size,
        stem_channels=stem_channels,
        stem_stride=preset.stem_stride,
        stem_resolution=stem_resolution,
        stages=tuple(stages),
        classes=classes,
    )


def stem_width(preset: Preset, w_index: int) -> int:
    return make_divisible(preset.stem_channels * preset.width_multipliers[w_index], preset.divisor)


def stage_width(preset: Preset, stage: int, w_index: int) -> int:
    return make_divisible(preset.stage_channels[stage] * preset.width_multipliers[w_index], preset.divisor)


def mid_width(preset: Preset, channels: int, ratio: float) -> int:
    return make_divisible(channels * ratio, preset.divisor)


@lru_cache(maxsize=65536)
def arch_layout(preset: Preset, arch: Arch, classes: int | None = None) -> Layout:
    """Active geometry of ``arch`` (validated against ``preset``)."""
    arch = arch.validated(preset)
    n = preset.num_stages
    channels = tuple(stage_width(preset, s, arch.w[s + 1]) for s in range(n))
    return _build(
        preset,
        preset.classes if classes is None else classes,
        stem_width(preset, arch.w[0]),
        tuple(1 + d for d in arch.d),
        channels,
        tuple(mid_width(preset, channels[s], arch.e[s]) for s in range(n)),
    )


def envelope_layout(
    preset: Preset,
    classes: int,
    stem_w: int,
    depths: tuple[int, ...],
    stage_w: tuple[int, ...],
) -> Layout:
    """Physical layout holding every variant with widths/depths up to the given maxima.

    Blocks keep the largest mid width any expansion ratio may need at the given
    width (method §5: ``mid_max = make_divisible(C·max(e))``).
    """
    n = preset.num_stages
    channels = tuple(stage_width(preset, s, stage_w[s]) for s in range(n))
    top = preset.expansion_ratios[-1]
    return _build(
        preset,
        classes,
        stem_width(preset, stem_w),
        tuple(1 + d for d in depths),
        channels,
        tuple(mid_width(preset, channels[s], top) for s in range(n)),
    )


def supernet_layout(preset: Preset, classes: int | None = None) -> Layout:
    """Physical geometry of the full supernet."""
    top = Arch.largest(preset)
    return envelope_layout(preset, preset.classes if classes is None else classes, top.w[0], top.d, top.w[1:])
