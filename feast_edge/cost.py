"""Analytic cost model: MACs and parameters of a Layout, no forward pass (SPEC §2).

MACs count conv and linear multiply-accumulates only; params count conv
weights, BN weight+bias (running statistics are buffers) and linear
weight+bias. The same formulas give a routed envelope's payload size.
"""

from __future__ import annotations

from feast_edge.arch import Arch
from feast_edge.geometry import Layout, arch_layout
from feast_edge.preset import Preset


def count_macs(layout: Layout) -> int:
    """Per-example multiply-accumulates of the network described by ``layout``."""
    macs = layout.in_channels * layout.stem_channels * 9 * layout.stem_resolution**2
    for stage in layout.stages:
        area = stage.resolution**2
        c_in = stage.in_channels
        for _ in range(stage.blocks):
            macs += c_in * stage.mid * 9 * area + stage.mid * stage.channels * 9 * area
            c_in = stage.channels
        macs += stage.in_channels * stage.channels * area  # block-0 projection
    return macs + layout.last_channels * layout.classes


def count_params(layout: Layout) -> int:
    """Trainable parameters of the network described by ``layout``."""
    params = layout.in_channels * layout.stem_channels * 9 + 2 * layout.stem_channels
    for stage in layout.stages:
        c_in = stage.in_channels
        for _ in range(stage.blocks):
            params += c_in * stage.mid * 9 + 2 * stage.mid + stage.mid * stage.channels * 9 + 2 * stage.channels
            c_in = stage.channels
        params += stage.in_channels * stage.channels + 2 * stage.channels  # block-0 projection
    return params + layout.last_channels * layout.classes + layout.classes


def arch_cost(preset: Preset, arch: Arch, classes: int | None = None) -> tuple[int, int]:
    """``(macs, params)`` of one architecture of ``preset``."""
    layout = arch_layout(preset, arch, classes)
    return count_macs(layout), count_params(layout)
