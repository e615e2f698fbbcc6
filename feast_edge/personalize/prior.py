"""Prior correction: the served model's logits shifted by ``τ·log p_device(class)``, no training.

A model trained on the federation's pooled data predicts as if every class were as frequent as it was there; a device
whose users see mostly shirts should predict shirts more readily. Bayes' rule with a changed label prior gives
``log p_device(y|x) = logit_y + log p_device(y) − log p_train(y) + const``; with the served task's classes taken as
equally frequent the last term is a constant and drops out (logit adjustment, Menon et al. 2021). ``τ`` scales the
correction: 0 is the served model, 1 the full Bayes correction.

Because the correction is a constant per class it folds into the classifier's bias: the personal model is the
served model with ``bias + τ·log p``, the same architecture and the same ONNX graph.
"""

from __future__ import annotations

import copy

import torch

from feast_edge.space.static import StaticResNet

SMOOTHING = 1.0  # Laplace pseudo-count per class: a class the device never showed is rare there, not impossible


def class_prior(labels: torch.Tensor, classes: int, smoothing: float = SMOOTHING) -> torch.Tensor:
    """The device's label prior over ``classes``, float64: ``(count + smoothing) / (n + smoothing·classes)``."""
    counts = torch.bincount(labels.reshape(-1).long().cpu(), minlength=classes)[:classes].double()
    return (counts + smoothing) / (counts.sum() + smoothing * classes)


def prior_offsets(prior: torch.Tensor, tau: float) -> torch.Tensor:
    """What prior correction adds to each class's logit: ``τ·log prior`` (float32)."""
    return (tau * torch.log(prior)).float()


def prior_corrected(model: StaticResNet, offsets: torch.Tensor) -> StaticResNet:
    """A copy of ``model`` whose logits are ``model``'s plus ``offsets`` (folded into the classifier's bias)."""
    personal = copy.deepcopy(model)
    with torch.no_grad():
        personal.classifier.bias.add_(offsets.to(personal.classifier.bias))
    return personal
