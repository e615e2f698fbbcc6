"""The stages of a round's release (feast_edge.run.release), and :func:`release_of`, which composes those a run's
settings ask for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from feast_edge.run.release import Release, Stage
from feast_edge.run.stages.compute_budget import ComputeBudgetStage
from feast_edge.run.stages.privacy_noise import PrivacyStage
from feast_edge.run.stages.released import ReleasedStage
from feast_edge.run.stages.server_step import ServerStepStage
from feast_edge.run.stages.weight_cap import WeightCapStage

if TYPE_CHECKING:
    from feast_edge.run.round_record import RoundMethod
    from feast_edge.settings.run_concerns import RunConcerns


def release_of(settings: RunConcerns, model: torch.nn.Module, method: RoundMethod) -> Release:
    """The stages ``settings`` ask for, in their fixed order: a compute budget (it only refuses steps), privacy (clip; noise after the aggregate), the cap on
    self-reported weights, the server optimizer (its step from the noised aggregate: post-processing), and, under
    secure aggregation, the record of which positions the releases moved."""
    params = [name for name, _ in model.named_parameters()]
    stages: list[Stage] = []
    if settings.compute_budget:
        stages.append(ComputeBudgetStage(settings.compute_budget))
    if settings.dp is not None:
        stages.append(PrivacyStage(settings.dp, params, settings.training.rounds, clients_noise=settings.dp_on_devices))
    if settings.weight_cap():
        stages.append(WeightCapStage(settings.weight_cap()))
    if not settings.server_opt.identity:
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        stages.append(ServerStepStage(settings.server_opt, shapes, method))
    if settings.reveal_over():  # secure sums: which positions the releases moved (after the noise: it only watches)
        stages.append(ReleasedStage(model))
    return Release(method, stages)
