"""Evaluation protocol: per-variant BN recalibration, accuracy, largest-affordable serving (SPEC §8)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from feast_edge.data.images import normalize
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet


def pixel_batches(images: torch.Tensor, preset: Preset, batch_size: int, device: str | torch.device = "cpu"):
    """Normalized float batches of uint8 ``images`` in their stored (fixed) order."""
    for start in range(0, images.shape[0], batch_size):
        chunk = images[start : start + batch_size].to(device)
        yield normalize(chunk.float().div_(255.0), preset.mean, preset.std)


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, preset: Preset, batch_size: int = 500, device: str | torch.device = "cpu") -> float:
    """Top-1 accuracy of ``model`` (eval mode) on uint8 ``images``."""
    model.eval()
    correct = 0
    for x, start in zip(pixel_batches(images, preset, batch_size, device), range(0, images.shape[0], batch_size)):
        pred = model(x).argmax(dim=1).cpu()
        correct += int((pred == labels[start : start + batch_size]).sum())
    return correct / max(1, images.shape[0])


def calibrated_variant(
    supernet: Supernet,
    arch: Arch,
    calibration_images: torch.Tensor,
    batch_size: int = 100,
    device: str | torch.device = "cpu",
) -> StaticResNet:
    """Extract ``arch`` and recalibrate its BN on the server-held calibration split (fixed order, no mixing)."""
    model = extract(supernet, arch).to(device)
    recalibrate_bn(model, pixel_batches(calibration_images, supernet.preset, batch_size, device))
    return model


def evaluate_variants(
    supernet: Supernet,
    archs: Sequence[Arch],
    calibration_images: torch.Tensor,
    images: torch.Tensor,
    labels: torch.Tensor,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Accuracy of every arch, each with its own BN recalibration (SPEC §8)."""
    results = []
    for i, arch in enumerate(archs):
        model = calibrated_variant(supernet, arch, calibration_images, device=device)
        results.append(accuracy(model, images, labels, supernet.preset, device=device))
        if progress is not None:
            progress(i + 1, len(archs))
    return results


def largest_affordable_index(macs: Sequence[int], budget: float) -> int:
    """Index of the largest variant with MACs <= budget in a MAC-sorted list."""
    best = -1
    for i, m in enumerate(macs):
        if m <= budget:
            best = i
    if best < 0:
        raise ValueError(f"budget {budget / 1e6:.2f}M MACs is below the smallest variant ({macs[0] / 1e6:.2f}M MACs)")
    return best


def population_accuracy(budgets: Sequence[float], macs: Sequence[int], variant_accuracy: Sequence[float]) -> float:
    """Mean over clients of the accuracy of the largest variant each can afford (SPEC §8)."""
    served = [variant_accuracy[largest_affordable_index(macs, b)] for b in budgets]
    return sum(served) / len(served)
