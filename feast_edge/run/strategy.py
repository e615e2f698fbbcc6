"""FEAST's round steps (method §5–§8) as one strategy: what ``feast-server`` runs and ``feast-edge simulate --method feast`` runs.

    plans(t, cohort, budget)        affordable set and envelope per cohort member     (route.plans.plan_client)
    payload_params(plan)            parameters of the routed sub-supernet               (method §5)
    aggregate(t, state, updates)    sparse sample-weighted mean, or a robust rule       (aggregate.robust.aggregate_updates)
    points() / point_network(p)     the cached variants, extracted and BN-recalibrated  (method §8)

Like Flower's strategies it holds no math of its own: it calls the stage
functions, so the server and the simulator cannot compute different things.
Local co-training is the device's (``feast_edge.local.update.client_update``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from feast_edge.aggregate.robust import aggregate_updates, check_rule
from feast_edge.aggregate.segments import SegmentSums, apply_sums
from feast_edge.aggregate.server_opt import routed_masks
from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.evaluate.points import OperatingPoint, ServedPoints
from feast_edge.route.plans import ClientPlan, plan_client
from feast_edge.run.collect import ClientUpdate
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.validated import RunError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import count_params
from feast_edge.space.geometry import supernet_layout
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet


class FeastStrategy(ServedPoints):
    """FEAST's plans, payload sizes, aggregation and operating points over one supernet and its variant cache."""

    @classmethod
    def of_settings(cls, model: Supernet, cache: VariantCache, settings: RunConcerns) -> FeastStrategy:
        """FEAST's steps with the aggregation rule a run's settings ask for (mean, clip, trimmed-mean or median)."""
        rule = settings.aggregation
        return cls(model, cache, rule.rule, rule.trim, rule.clip_norm)

    def __init__(
        self,
        model: Supernet,
        cache: VariantCache,
        aggregation: str = "mean",
        trim: float = 0.1,
        clip_norm: float | None = None,
    ) -> None:
        check_rule(aggregation, trim, clip_norm)
        self.model, self.cache = model, cache
        self.preset = model.preset
        self.aggregation, self.trim, self.clip_norm = aggregation, trim, clip_norm
        self.validated: list[dict[str, Any]] = []

    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, ClientPlan]:
        """Each cohort member's affordable set ``A_i`` and its envelope (method §5)."""
        return {c: plan_client(self.cache, budget(c)) for c in cohort}

    def payload_params(self, plan: ClientPlan) -> int:
        """Parameters of the routed sub-supernet (one direction; the update comes back the same size)."""
        return count_params(plan.layout(self.preset, self.model.classes))

    def full_params(self) -> int:
        """Parameters of the whole supernet (what broadcasting it to one client sends)."""
        return count_params(supernet_layout(self.preset, self.model.classes))

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        """Fold the valid updates into ``global_state`` in place (method §6, or the robust rule chosen)."""
        updates = [(u.client, u.state, u.samples) for u in updates]
        aggregate_updates(
            global_state, updates, inplace=True, rule=self.aggregation, trim=self.trim, clip_norm=self.clip_norm
        )

    def aggregate_sums(self, t: int, global_state: Mapping[str, torch.Tensor], sums: SegmentSums) -> None:
        """Method §6 from per-segment sums, in place (feast_edge.aggregate.segments); a robust rule needs each
        update, so it refuses them."""
        if self.aggregation != "mean":
            raise RunError(
                f"--aggregation {self.aggregation} needs each device's update; a collector that delivers per-segment "
                "sums takes --aggregation mean"
            )
        apply_sums(dict(global_state), sums)

    def routed(
        self, global_state: Mapping[str, torch.Tensor], updates: Sequence[ClientUpdate], names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """The union of the updates' leading slices, per tensor of ``names`` (where a server optimizer steps)."""
        return routed_masks(global_state, [u.state for u in updates], names)

    def points(self) -> list[OperatingPoint]:
        """The cached variants, sorted by MACs."""
        return [
            OperatingPoint(f"variant {i}", e.macs, e.params, e.arch.to_dict()) for i, e in enumerate(self.cache.entries)
        ]

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> StaticResNet:
        """The cached variant extracted as a static network, BN recalibrated (method §8)."""
        return calibrated_variant(self.model, Arch.from_dict(dict(point.detail)), calibration_images, device=device)
