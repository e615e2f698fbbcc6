"""Budget-tailored routing: the envelope of a client's affordable set as a physical sub-supernet (method §5).

The envelope is the coordinate-wise maximum of depths and width indices over
the affordable variants; its blocks keep the largest mid width any expansion
ratio may need at the routed width. Because local and global tensors share
names and local tensors are leading slices, the map Ω_i back to global
positions is, per tensor name, the local shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from feast_edge.space.arch import Arch
from feast_edge.space.cost import count_params
from feast_edge.space.geometry import Layout, envelope_layout, supernet_layout
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet, state_shapes
from feast_edge.util.slicing import leading_slice


@dataclass(frozen=True)
class Envelope:
    """Coordinate-wise maximum of an affordable set: stem width index, extra blocks and width index per stage."""

    stem_w: int
    depths: tuple[int, ...]
    stage_w: tuple[int, ...]

    @classmethod
    def of(cls, archs: Iterable[Arch]) -> "Envelope":
        """The envelope ``d*_s = max d_s(a)``, ``w*_j = max w_j(a)`` over ``archs`` (method §5)."""
        archs = list(archs)
        if not archs:
            raise ValueError(
                "the envelope of an empty affordable set is undefined; the client can afford no cached variant"
            )
        n = len(archs[0].d)
        return cls(
            stem_w=max(a.w[0] for a in archs),
            depths=tuple(max(a.d[s] for a in archs) for s in range(n)),
            stage_w=tuple(max(a.w[s + 1] for a in archs) for s in range(n)),
        )

    def layout(self, preset: Preset, classes: int | None = None) -> Layout:
        """Physical geometry of the routed sub-supernet."""
        return envelope_layout(
            preset, preset.classes if classes is None else classes, self.stem_w, self.depths, self.stage_w
        )

    def params(self, preset: Preset, classes: int | None = None) -> int:
        """Payload size P_i in parameters (method §2 rules)."""
        return count_params(self.layout(preset, classes))

    def contains(self, other: "Envelope") -> bool:
        """True when ``other`` is a leading slice of this envelope."""
        return (
            other.stem_w <= self.stem_w
            and all(a <= b for a, b in zip(other.depths, self.depths))
            and all(a <= b for a, b in zip(other.stage_w, self.stage_w))
        )

    def to_dict(self) -> dict[str, object]:
        return {"stem_w": self.stem_w, "depths": list(self.depths), "stage_w": list(self.stage_w)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "Envelope":
        return cls(int(data["stem_w"]), tuple(int(v) for v in data["depths"]), tuple(int(v) for v in data["stage_w"]))  # type: ignore[arg-type,union-attr]


@torch.no_grad()
def route_state(global_state: Mapping[str, torch.Tensor], layout: Layout, preset: Preset) -> dict[str, torch.Tensor]:
    """Copies of the leading slices of ``global_state`` that a sub-supernet of ``layout`` holds."""
    return {
        name: leading_slice(global_state[name], shape).clone() for name, shape in state_shapes(preset, layout).items()
    }


def sub_supernet(global_model: Supernet, envelope: Envelope) -> Supernet:
    """A physical sub-supernet holding copies of the routed slices of ``global_model``."""
    layout = envelope.layout(global_model.preset, global_model.classes)
    local = Supernet(global_model.preset, layout=layout, seed=None)
    local.load_state_dict(route_state(global_model.state_dict(), layout, global_model.preset))
    return local


@dataclass(frozen=True)
class CommunicationReport:
    """Routed vs full-supernet payloads over a client population (method §5)."""

    full_params: int
    payloads: tuple[int, ...]  # P_i per client

    @property
    def mean_payload(self) -> float:
        return sum(self.payloads) / len(self.payloads)

    @property
    def aggregate_reduction(self) -> float:
        """Expected per-round traffic ratio ``2·m·P / 2·Σ P_i`` under uniform cohort sampling."""
        return self.full_params / self.mean_payload

    @property
    def reductions(self) -> list[float]:
        return sorted(self.full_params / p for p in self.payloads)

    @property
    def median_reduction(self) -> float:
        r = self.reductions
        mid = len(r) // 2
        return r[mid] if len(r) % 2 else (r[mid - 1] + r[mid]) / 2


def communication_report(
    preset: Preset, archs_by_macs: Sequence[tuple[int, Arch]], budgets: Iterable[float], classes: int | None = None
) -> CommunicationReport:
    """Payload P_i of every client's routed envelope, against the full supernet."""
    classes = preset.classes if classes is None else classes
    full = count_params(supernet_layout(preset, classes))
    sizes = {}
    payloads = []
    for budget in budgets:
        affordable = tuple(a for m, a in archs_by_macs if m <= budget)
        if affordable not in sizes:
            sizes[affordable] = Envelope.of(affordable).params(preset, classes)
        payloads.append(sizes[affordable])
    return CommunicationReport(full, tuple(payloads))
