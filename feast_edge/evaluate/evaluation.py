"""Evaluation protocol (method §8): per-variant BN recalibration, accuracy, validation probes, largest-affordable serving, population accuracy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch
from torch import nn

from feast_edge.data.images import normalize
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet

P = TypeVar("P")


@dataclass(frozen=True)
class Validation:
    """Server-held data for checkpoint selection: BN-calibration images and a labelled validation split."""

    calibration_images: torch.Tensor
    images: torch.Tensor
    labels: torch.Tensor


def pixel_batches(images: torch.Tensor, preset: Preset, batch_size: int, device: str | torch.device = "cpu"):
    """Normalized float batches of uint8 ``images`` in their stored (fixed) order."""
    for start in range(0, images.shape[0], batch_size):
        chunk = images[start : start + batch_size].to(device)
        yield normalize(chunk.float().div_(255.0), preset.mean, preset.std)


@torch.no_grad()
def correct_count(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    batch_size: int = 500,
    device: str | torch.device = "cpu",
) -> int:
    """Top-1 correct predictions of ``model`` (eval mode) on uint8 ``images``."""
    model.eval()
    correct = 0
    for x, start in zip(pixel_batches(images, preset, batch_size, device), range(0, images.shape[0], batch_size)):
        pred = model(x).argmax(dim=1).cpu()
        correct += int((pred == labels[start : start + batch_size]).sum())
    return correct


def accuracy(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    batch_size: int = 500,
    device: str | torch.device = "cpu",
) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on uint8 ``images``."""
    return correct_count(model, images, labels, preset, batch_size, device) / max(1, images.shape[0])


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


def evaluate_points(
    points: Sequence[P],
    network: Callable[[P], nn.Module],
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Top-1 accuracy of ``network(point)`` for every point, one network alive at a time: the one evaluation loop (method §8).

    ``network`` builds what a device served that point runs, BN recalibrated (e.g. :func:`calibrated_variant`).
    """
    results = []
    for i, point in enumerate(points):
        results.append(accuracy(network(point), images, labels, preset, device=device))
        if progress is not None:
            progress(i + 1, len(points))
    return results


def evaluate_variants(
    supernet: Supernet,
    archs: Sequence[Arch],
    calibration_images: torch.Tensor,
    images: torch.Tensor,
    labels: torch.Tensor,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Accuracy of every arch, each with its own BN recalibration (method §8)."""
    network = partial(_calibrated, supernet, calibration_images, device)
    return evaluate_points(archs, network, images, labels, supernet.preset, device, progress)


def _calibrated(
    supernet: Supernet, calibration_images: torch.Tensor, device: str | torch.device, arch: Arch
) -> StaticResNet:
    return calibrated_variant(supernet, arch, calibration_images, device=device)


def probe_indices(n: int, k: int) -> list[int]:
    """``k`` of ``n`` rank-sorted points evenly spaced by rank, smallest and largest included: the validation probes (method §8)."""
    if k >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)})


def largest_affordable_index(macs: Sequence[int], budget: float) -> int:
    """Index of the largest variant with MACs <= budget in a MAC-sorted list."""
    best = -1
    for i, m in enumerate(macs):
        if m <= budget:
            best = i
    if best < 0:
        raise ValueError(f"budget {budget / 1e6:.2f}M MACs is below the smallest variant ({macs[0] / 1e6:.2f}M MACs)")
    return best


def population_accuracy(served: Sequence[int], variant_accuracy: Sequence[float]) -> float:
    """Mean over clients of the accuracy of the variant each is served (method §8: the largest it can afford, :func:`largest_affordable_index`)."""
    return sum(variant_accuracy[i] for i in served) / len(served)
