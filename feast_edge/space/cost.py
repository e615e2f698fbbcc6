"""Analytic cost model: MACs and parameters of a Layout, no forward pass (method §2).

MACs count conv and linear multiply-accumulates only; params count conv
weights, BN weight+bias (running statistics are buffers) and linear
weight+bias. The same formulas give a routed envelope's payload size.
"""

from __future__ import annotations

from dataclasses import dataclass

from feast_edge.space.arch import Arch
from feast_edge.space.geometry import Layout, arch_layout
from feast_edge.space.preset import Preset


@dataclass(frozen=True)
class PartCost:
    """MACs and params of one part of the network (stem, a stage, the classifier)."""

    part: str
    macs: int
    params: int


def cost_breakdown(layout: Layout) -> list[PartCost]:
    """Per-part cost: stem, each stage (blocks + block-0 projection), classifier."""
    c_stem = layout.stem_channels
    parts = [
        PartCost(
            "stem",
            layout.in_channels * c_stem * 9 * layout.stem_resolution**2,
            layout.in_channels * c_stem * 9 + 2 * c_stem,
        )
    ]
    for i, stage in enumerate(layout.stages):
        area, mid, c = stage.resolution**2, stage.mid, stage.channels
        # block-0 projection (1x1 conv + BN)
        macs, params = stage.in_channels * c * area, stage.in_channels * c + 2 * c
        c_in = stage.in_channels
        for _ in range(stage.blocks):
            macs += (c_in * mid + mid * c) * 9 * area
            params += c_in * mid * 9 + 2 * mid + mid * c * 9 + 2 * c
            c_in = c
        parts.append(PartCost(f"stage {i + 1}", macs, params))
    c_last = layout.last_channels
    parts.append(PartCost("classifier", c_last * layout.classes, c_last * layout.classes + layout.classes))
    return parts


def count_macs(layout: Layout) -> int:
    """Per-example multiply-accumulates of the network described by ``layout``."""
    return sum(p.macs for p in cost_breakdown(layout))


def count_params(layout: Layout) -> int:
    """Trainable parameters of the network described by ``layout``."""
    return sum(p.params for p in cost_breakdown(layout))


def arch_cost(preset: Preset, arch: Arch, classes: int | None = None) -> tuple[int, int]:
    """``(macs, params)`` of one architecture of ``preset``."""
    layout = arch_layout(preset, arch, classes)
    return count_macs(layout), count_params(layout)
