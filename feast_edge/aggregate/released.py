"""Which positions of the global model some release has moved (method §6), and so which variants trained.

Under secure aggregation a withheld segment keeps θ_t (docs/security.md §10): a slice can go through a whole run
without leaving its initial value, and a variant holding it must not be served. ``Released`` keeps one bit per
position of every floating tensor:

    Released(global_state)       nothing released yet
    .add_sums(sums)              the cells of every released segment (feast_edge.aggregate.segments)
    .add_routed(states)          every position of the given routed states (a plain release moves all of them)
    .tensors() / .load(...)      the bits packed, 8 positions a byte, for the checkpoint
    trained_variants(...)        the cache indices of the variants whose every position moved
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from feast_edge.aggregate.segments import SegmentSums, _index
from feast_edge.cache.variants import VariantCache
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import state_shapes

PREFIX = "released/"  # the checkpoint's tensors of what moved: released/<tensor name>, packed bits


class Released:
    """One bit per position of ``global_state``'s floating tensors: whether some release moved it."""

    def __init__(self, global_state: Mapping[str, torch.Tensor]) -> None:
        self.moved = {
            name: torch.zeros(t.shape, dtype=torch.bool) for name, t in global_state.items() if t.is_floating_point()
        }

    def add_sums(self, sums: SegmentSums) -> None:
        """The cells of every segment whose sum was released."""
        for s in sums.sums:
            for name, cells in s.segment.cells.items():
                if name in self.moved:
                    for cell in cells:
                        self.moved[name][_index(cell)] = True

    def add_routed(self, states: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Every floating position of the given routed (leading-slice) states."""
        for state in states:
            for name, value in state.items():
                if name in self.moved and value.is_floating_point():
                    self.moved[name][tuple(slice(0, n) for n in value.shape)] = True

    def holds(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """Whether every position of the leading slices ``shapes`` (name -> shape) moved."""
        return all(
            bool(self.moved[name][tuple(slice(0, n) for n in shape)].all())
            for name, shape in shapes.items()
            if name in self.moved
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """The bits, packed (uint8), by :data:`PREFIX` + tensor name."""
        return {
            PREFIX + name: torch.from_numpy(np.packbits(bits.reshape(-1).numpy())) for name, bits in self.moved.items()
        }

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """The bits of :meth:`tensors` back (ValueError when one is missing or of another size)."""
        for name, bits in self.moved.items():
            packed = tensors.get(PREFIX + name)
            if packed is None or packed.numel() != (bits.numel() + 7) // 8:
                raise ValueError(f"no record of {name}'s released positions, or one of another shape")
            unpacked = np.unpackbits(packed.numpy().astype(np.uint8), count=bits.numel())
            self.moved[name] = torch.from_numpy(unpacked.astype(bool)).reshape(bits.shape)


def variant_shapes(preset: Preset, cache: VariantCache, index: int) -> dict[str, tuple[int, ...]]:
    """The leading slices of the global model the cached variant ``index`` is made of (what extraction copies)."""
    return state_shapes(preset, arch_layout(preset, cache.entries[index].arch, preset.classes))


def trained_variants(preset: Preset, cache: VariantCache, released: Released) -> frozenset[int]:
    """The cache indices of the variants whose every position some release moved."""
    return frozenset(i for i in range(len(cache)) if released.holds(variant_shapes(preset, cache, i)))


def recorded_variants(
    preset: Preset, cache: VariantCache, state: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor]
) -> frozenset[int] | None:
    """The trained variants a checkpoint records (``state``: its model's tensors, ``extra``: its extra tensors);
    None when it records no released positions (a plain run: every routed position moves)."""
    if not any(name.startswith(PREFIX) for name in extra):
        return None
    released = Released(state)
    released.load(extra)
    return trained_variants(preset, cache, released)
