"""Evaluation where the data lives (SPEC §8 on the devices): a server that holds no data validates and calibrates this way.

    device:  held_out_counts(routed sub-supernet, probes, its training split, its held-out split)
               each probe extracted, BN recalibrated on ``calibration`` training examples (a fixed, seeded
               sample: files sorted by class would describe one class), tested on the held-out split
    server:  combine_counts(every device's counts) -> per probe Σ correct / Σ total (sample-weighted)
             federated_accuracy(...) -> the mean over the probes some device tested: the round's validation accuracy

    device:  calibrated_static(served variant's weights, its training split) -> the model its ONNX file holds

The same recalibration as the server-held protocol (``evaluation.calibrated_variant``), only on each
device's own examples; no example leaves the device, only counts do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from feast_edge.evaluate.evaluation import calibrated_variant, correct_count, pixel_batches
from feast_edge.route.plans import ClientPlan
from feast_edge.space.arch import Arch
from feast_edge.space.extract import recalibrate_bn
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet

CALIBRATION = (
    500  # training examples a device recalibrates BN on by default (the server-held protocol's --calib-samples)
)


def calibration_subset(
    images: torch.Tensor, count: int, labels: torch.Tensor | None = None, seed: int = 0
) -> torch.Tensor:
    """``count`` of a device's training ``images`` for BN recalibration, in a fixed, seeded order.

    With ``labels``, class-balanced: each of the ``k`` classes present gives ``count // k`` examples (drawn without
    replacement where it has that many, with replacement where it has fewer), so the BN statistics describe the
    device's classes as if they were equally frequent, as the served task's classes are assumed to be. A device's
    data is skewed (non-IID): on the demo's Dirichlet shards this recalibration lifted the small devices' test
    accuracy from 66-68 % to 71-72 % against the device's own class frequencies (docs/benchmarks.md). Without
    ``labels``, a seeded random sample (a device's files are often sorted by class: its first ``count`` would
    describe one or two classes).
    """
    generator = torch.Generator().manual_seed(seed)
    if labels is None or labels.numel() == 0:
        order = torch.randperm(int(images.shape[0]), generator=generator)
        return images[order[:count]]
    classes = torch.unique(labels)
    quota = max(1, count // len(classes))
    picks = []
    for c in classes.tolist():
        members = (labels == c).nonzero().flatten()
        if len(members) >= quota:
            picks.append(members[torch.randperm(len(members), generator=generator)[:quota]])
        else:
            picks.append(members[torch.randint(len(members), (quota,), generator=generator)])
    index = torch.cat(picks)
    return images[index[torch.randperm(len(index), generator=generator)]]


def routed_supernet(preset: Preset, plan: ClientPlan, routed_state: Mapping[str, torch.Tensor]) -> Supernet:
    """The routed sub-supernet of ``plan`` holding ``routed_state`` (what a device trains, here to evaluate)."""
    model = Supernet(preset, classes=preset.classes, layout=plan.layout(preset, preset.classes), seed=None)
    model.load_state_dict(routed_state)
    return model


def held_out_counts(
    supernet: Supernet,
    probes: Sequence[Arch],
    train_images: torch.Tensor,
    holdout_images: torch.Tensor,
    holdout_labels: torch.Tensor,
    calibration: int = CALIBRATION,
    device: str | torch.device = "cpu",
    train_labels: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """(correct, total) of every probe on the held-out split, each BN-recalibrated on the training split first (SPEC §8)."""
    total = int(holdout_labels.shape[0])
    if total == 0 or train_images.shape[0] == 0:
        return [(0, 0) for _ in probes]
    calibration_images = calibration_subset(train_images, calibration, train_labels)
    counts = []
    for arch in probes:
        model = calibrated_variant(supernet, arch, calibration_images, device=device)
        counts.append((correct_count(model, holdout_images, holdout_labels, supernet.preset, device=device), total))
    return counts


def combine_counts(reports: Iterable[Sequence[tuple[int, int]]], probes: int) -> list[tuple[int, int]]:
    """Per probe, Σ correct and Σ total over the devices' reports (each lists one pair per probe)."""
    combined = [(0, 0)] * probes
    for counts in reports:
        combined = [(c + dc, n + dn) for (c, n), (dc, dn) in zip(combined, counts)]
    return combined


def federated_accuracy(combined: Sequence[tuple[int, int]]) -> float | None:
    """Mean over the probes some device tested of their sample-weighted accuracy; None when none was tested."""
    tested = [c / n for c, n in combined if n > 0]
    return sum(tested) / len(tested) if tested else None


def calibrated_static(
    model: StaticResNet,
    preset: Preset,
    images: torch.Tensor,
    calibration: int = CALIBRATION,
    batch_size: int = 100,
    labels: torch.Tensor | None = None,
) -> int:
    """Recalibrate a served variant's BN on ``calibration`` of ``images`` (a device's training split, chosen by
    :func:`calibration_subset`, class-balanced with ``labels``); returns how many examples it saw."""
    subset = calibration_subset(images, calibration, labels)
    return recalibrate_bn(model, pixel_batches(subset, preset, batch_size))
