"""Fine-tuning the served model on the device's own examples, three ways that differ in what may move.

* ``head``: the classifier only, on the frozen body's features (FedPer/FedRep's personal head);
* ``bn``: the BatchNorm layers only, their affine parameters and running statistics (FedBN's local BN);
* ``proximal``: every layer, with ``μ/2·‖w − w_served‖²`` added to the loss so the model stays near the served one
  (Ditto's personal model).

Each runs a few epochs of plain SGD on un-augmented mini-batches drawn from a seeded generator; the served model is
never changed. How many epochs (``head``, ``bn``) or how strong the pull (``proximal``) is the method's *strength*,
chosen by ``feast_edge.personalize.select`` on a selection split.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.data.images import normalize
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet

FINE_TUNED = ("head", "bn", "proximal")
LR = {"head": 0.01, "bn": 0.01, "proximal": 0.005}  # SGD step per method (momentum 0.9, batch BATCH)
BATCH = 32
PROXIMAL_EPOCHS = 2


def _trainable(model: StaticResNet, method: str) -> list[nn.Parameter]:
    """The parameters ``method`` may change (the others are frozen)."""
    if method == "head":
        return list(model.classifier.parameters())
    if method == "bn":
        return [p for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()]
    return list(model.parameters())


def _body_features(model: StaticResNet, images: torch.Tensor, preset: Preset, device: torch.device) -> torch.Tensor:
    """The frozen body's pooled features of ``images`` (eval mode): what the head fine-tunes on."""
    head, model.classifier = model.classifier, nn.Identity()
    try:
        model.eval()
        with torch.no_grad():
            return torch.cat([model(x) for x in pixel_batches(images, preset, 500, device)])
    finally:
        model.classifier = head


def fine_tuned(
    served: StaticResNet,
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    method: str,
    strengths: Sequence[float],
    generator: torch.Generator,
    device: str | torch.device = "cpu",
) -> list[StaticResNet]:
    """Copies of ``served`` fine-tuned by ``method`` on uint8 ``images``, one per strength: epochs for ``head`` and
    ``bn`` (one run, a copy taken after each listed epoch), ``μ`` for ``proximal`` (one run of PROXIMAL_EPOCHS epochs
    each). Shuffling draws from ``generator`` only; ``served`` is left as it was."""
    if method not in FINE_TUNED:
        raise ValueError(f"fine-tuning method {method!r} is unknown; choose one of {', '.join(FINE_TUNED)}")
    if method == "proximal":
        return [
            _run(served, images, labels, preset, method, PROXIMAL_EPOCHS, mu, generator, device)[-1] for mu in strengths
        ]
    epochs = [int(e) for e in strengths]
    if any(e < 1 for e in epochs):
        raise ValueError(f"{method} fine-tuning needs at least one epoch, got {list(strengths)}")
    snapshots = _run(served, images, labels, preset, method, max(epochs), 0.0, generator, device)
    return [snapshots[e - 1] for e in epochs]


def _run(
    served: StaticResNet,
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    method: str,
    epochs: int,
    mu: float,
    generator: torch.Generator,
    device: str | torch.device,
) -> list[StaticResNet]:
    """``epochs`` epochs of ``method`` on a copy of ``served``: the model after each epoch (eval mode, on the CPU)."""
    device = torch.device(device)
    model = copy.deepcopy(served).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    params = _trainable(model, method)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params, lr=LR[method], momentum=0.9)
    anchor = [p.detach().clone() for p in params] if method == "proximal" else []
    features = _body_features(model, images, preset, device) if method == "head" else None
    targets = labels.to(device)
    after: list[StaticResNet] = []
    for _ in range(epochs):
        for index in torch.randperm(int(labels.shape[0]), generator=generator).split(BATCH):
            index = index.to(device)
            if features is not None:
                logits = model.classifier(features[index])
            elif len(index) < 2:
                continue  # train-mode BatchNorm cannot normalize a batch of one
            else:
                model.train()
                pixels = images[index.cpu()].to(device).float().div_(255.0)
                logits = model(normalize(pixels, preset.mean, preset.std))
            loss = F.cross_entropy(logits, targets[index])
            if anchor:
                loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        snapshot = copy.deepcopy(model).eval().cpu()
        for p in snapshot.parameters():
            p.requires_grad_(True)
        after.append(snapshot)
    return after
