"""What the server decides for one client (method §5, §7): its affordable set, the set's envelope, the payload's manifest."""

from __future__ import annotations

from dataclasses import dataclass

from feast_edge.cache.variants import VariantCache
from feast_edge.route.envelope import Envelope
from feast_edge.route.payload import Manifest
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset


@dataclass(frozen=True)
class ClientPlan:
    """What the server decides for one client: its affordable variants and their envelope (method §5, §7)."""

    affordable: tuple[Arch, ...]
    global_min: Arch
    envelope: Envelope

    def layout(self, preset: Preset, classes: int):
        return self.envelope.layout(preset, classes)

    def manifest(
        self,
        preset: Preset,
        classes: int,
        round_index: int,
        kind: str,
        device: str | None = None,
        dtype: str = "float32",
    ) -> Manifest:
        """The manifest of this plan's routed payload (``kind="routed"``) or of the update it comes back as, in payload ``dtype``."""
        return Manifest.of(preset, classes, self.envelope, round_index, kind, device, dtype)


def plan_client(cache: VariantCache, budget: float) -> ClientPlan:
    """Affordable set ``A_i = {a : MAC(a) <= b_i}`` (raw budget) and its envelope."""
    affordable = tuple(entry.arch for entry in cache.affordable(budget))
    if not affordable:
        cache.largest_affordable(budget)  # raises the user-facing error naming the smallest variant
    return ClientPlan(affordable, cache.smallest.arch, Envelope.of(affordable))
