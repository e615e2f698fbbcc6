"""One client's update (method §7): build the routed sub-supernet, co-train it on local data, return its state."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from feast_edge.local.cotrain import LocalResult, local_train
from feast_edge.local.recipe import TrainConfig
from feast_edge.route.plans import ClientPlan
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet


def client_update(
    preset: Preset,
    classes: int,
    plan: ClientPlan,
    routed_state: Mapping[str, torch.Tensor],
    images: torch.Tensor,
    labels: torch.Tensor,
    config: TrainConfig,
    lr: float,
    seed: int,
    device: str | torch.device = "cpu",
    amp: str = "off",
    between_steps: Callable[[], None] | None = None,
) -> tuple[dict[str, torch.Tensor], LocalResult]:
    """Build the routed sub-supernet, co-train it on local data (``amp``: feast_edge.local.precision), return its updated
    state (method §7); ``between_steps`` is called after every step (:func:`feast_edge.local.cotrain.local_train`)."""
    model = Supernet(preset, classes=classes, layout=plan.layout(preset, classes), seed=None)
    model.load_state_dict(routed_state)
    result = local_train(
        model,
        images,
        labels,
        plan.affordable,
        plan.global_min,
        config,
        lr=lr,
        seed=seed,
        device=device,
        amp=amp,
        between_steps=between_steps,
    )
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    return state, result
