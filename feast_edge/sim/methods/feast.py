"""FEAST itself as a harness method (method §5–§8): the strategy ``feast-server`` runs, plus local training in process.

Plans, payload sizes, aggregation (the sparse sample-weighted mean, or a robust
rule, ``--aggregation``) and the operating points (the cached variants, each
evaluated after its own BN recalibration) are :class:`FeastStrategy`'s, the
very object the server's run loop uses; what this class adds is the client's
side: the routed sub-supernet (``route_state``) co-trained on its shard
(``client_update``, with ``config.training.variants`` choosing the paper's ablations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from feast_edge.aggregate.segments import SegmentSums
from feast_edge.evaluate.points import OperatingPoint
from feast_edge.local.update import client_update
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.strategy import FeastStrategy
from feast_edge.sim.methods.base import Method
from feast_edge.space.supernet import Supernet

if TYPE_CHECKING:
    from feast_edge.sim.setup import Setup, SimulationConfig


class Feast(Method):
    name = "feast"
    private_aggregation = True  # sparse mean of leading slices (feast_edge.privacy)
    summary = "FEAST: routed sub-supernets, multi-variant co-training, sparse sample-weighted aggregation"

    def __init__(self, setup: Setup, config: SimulationConfig) -> None:
        super().__init__(setup, config)
        self.strategy = FeastStrategy(
            self.model, setup.cache, config.aggregation.rule, config.aggregation.trim, config.aggregation.clip_norm
        )

    def build_model(self) -> Supernet:
        return Supernet(self.preset, seed=self.config.seed)

    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, ClientPlan]:
        return self.strategy.plans(t, cohort, budget)

    def payload_params(self, plan: ClientPlan) -> int:
        return self.strategy.payload_params(plan)

    def full_params(self) -> int:
        return self.strategy.full_params()

    def train_client(
        self,
        t: int,
        client: str,
        plan: ClientPlan,
        global_state: Mapping[str, torch.Tensor],
        images: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        seed: int,
    ) -> ClientUpdate:
        preset = self.preset
        state = route_state(global_state, plan.layout(preset, preset.classes), preset)
        new_state, result = client_update(
            preset,
            preset.classes,
            plan,
            state,
            images,
            labels,
            self.config.train_config(),
            lr,
            seed,
            self.config.device,
            self.config.amp,
        )
        return ClientUpdate(
            client,
            new_state,
            result.num_samples,
            loss=result.mean_loss,
            samples_seen=result.samples_seen,
            train_macs=result.train_macs,
            variants_per_batch={str(k): v for k, v in result.variants_per_batch.items()},
        )

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        self.strategy.aggregate(t, global_state, updates, plans)

    def aggregate_sums(self, t: int, global_state: Mapping[str, torch.Tensor], sums: SegmentSums) -> None:
        self.strategy.aggregate_sums(t, global_state, sums)

    def points(self) -> list[OperatingPoint]:
        return self.strategy.points()

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> nn.Module:
        return self.strategy.point_network(point, calibration_images, device)
