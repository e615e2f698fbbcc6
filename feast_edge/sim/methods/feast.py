"""FEAST itself as a harness method (SPEC §5–§8): the one ``feast-server`` runs, with the same functions.

Plans are affordable sets and their envelopes (``plan_client``), payloads the
routed sub-supernets (``route_state``), local training the multi-variant
co-training (``client_update``, with ``config.variants`` choosing the paper's
ablations), aggregation the sparse sample-weighted mean (or a robust rule,
``--aggregation``), and the operating points the cached variants, each
evaluated after its own BN recalibration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.local.update import client_update
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import ClientPlan, plan_client
from feast_edge.run.loop import ClientUpdate, FeastRounds, RunSettings
from feast_edge.sim.methods.base import Method, OperatingPoint
from feast_edge.space.arch import Arch
from feast_edge.space.cost import count_params
from feast_edge.space.supernet import Supernet


class Feast(Method):
    name = "feast"
    summary = "FEAST: routed sub-supernets, multi-variant co-training, sparse sample-weighted aggregation"

    def build_model(self) -> Supernet:
        return Supernet(self.preset, seed=self.config.seed)

    def _rounds(self) -> FeastRounds:
        c = self.config
        settings = RunSettings(rounds=c.rounds, per_round=c.per_round, min_clients=1, seed=c.seed, lr=1.0, aggregation=c.aggregation, trim=c.trim, clip_norm=c.clip_norm)
        return FeastRounds(self.model, self.setup.cache, settings)

    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, ClientPlan]:
        return {c: plan_client(self.setup.cache, budget(c)) for c in cohort}

    def payload_params(self, plan: ClientPlan) -> int:
        return count_params(plan.layout(self.preset, self.preset.classes))

    def full_params(self) -> int:
        return self._rounds().full_params()

    def train_client(
        self, t: int, client: str, plan: ClientPlan, global_state: Mapping[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor, lr: float, seed: int
    ) -> ClientUpdate:
        preset = self.preset
        state = route_state(global_state, plan.layout(preset, preset.classes), preset)
        new_state, result = client_update(preset, preset.classes, plan, state, images, labels, self.config.train_config(), lr, seed, self.config.device, self.config.amp)
        return ClientUpdate(
            client, new_state, result.num_samples, loss=result.mean_loss, samples_seen=result.samples_seen, train_macs=result.train_macs,
            variants_per_batch={str(k): v for k, v in result.variants_per_batch.items()},
        )

    def aggregate(self, t: int, global_state: Mapping[str, torch.Tensor], updates: Sequence[ClientUpdate], plans: Mapping[str, Any]) -> None:
        self._rounds().aggregate(t, global_state, updates, plans)

    def points(self) -> list[OperatingPoint]:
        return [OperatingPoint(f"variant {i}", e.macs, e.params, e.arch.to_dict()) for i, e in enumerate(self.setup.cache.entries)]

    def point_network(self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu") -> nn.Module:
        """The cached variant extracted as a static network, BN recalibrated (SPEC §8)."""
        return calibrated_variant(self.model, Arch.from_dict(dict(point.detail)), calibration_images, device=device)
