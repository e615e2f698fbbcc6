"""Operating points and what is measured of them (method §8): the models a method serves, probed, tested and served by budget.

Every method (FEAST on the server and in the harness, the baselines) states
its operating points and the network a device served one of them runs;
:class:`ServedPoints` turns that into validation, test accuracy and serving by
the same functions (:mod:`feast_edge.evaluate.evaluation`), so no method
evaluates by a loop of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from feast_edge.evaluate.evaluation import Validation, evaluate_points, largest_affordable_index, probe_indices
from feast_edge.space.preset import Preset


@dataclass(frozen=True)
class OperatingPoint:
    """One model a method can serve: its label, inference MACs and parameters, and what identifies it.

    ``detail`` is JSON data (a FEAST arch dict, a HeteroFL tier, a ScaleFL level, a FIARSE size).
    For methods whose sparsity does not reduce dense compute (FIARSE), ``macs`` is the nominal
    budget the point is served at and ``dense_macs`` what a device actually computes.
    """

    label: str
    macs: int
    params: int
    detail: Mapping[str, Any] = field(default_factory=dict)
    dense_macs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "macs": self.macs,
            "params": self.params,
            "detail": dict(self.detail),
            "dense_macs": self.dense_macs,
        }


class ServedPoints:
    """Validation, testing and serving over a method's operating points; a subclass gives :meth:`points` and :meth:`point_network`."""

    preset: Preset
    validated: list[dict[str, Any]]  # the latest validation, per probe point (label, macs, params, val_accuracy)

    def points(self) -> list[OperatingPoint]:
        """The operating points served to devices, sorted by MACs."""
        raise NotImplementedError

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> nn.Module:
        """The network a device served ``point`` runs (normalized images in, logits out), BN recalibrated on ``calibration_images``, eval mode."""
        raise NotImplementedError

    def probe_points(self, k: int) -> list[OperatingPoint]:
        """``k`` points evenly spaced by rank (smallest and largest included): what validation averages."""
        points = self.points()
        return [points[i] for i in probe_indices(len(points), k)]

    def evaluate(
        self,
        points: Sequence[OperatingPoint],
        calibration_images: torch.Tensor,
        images: torch.Tensor,
        labels: torch.Tensor,
        device: str | torch.device = "cpu",
        progress: Callable[[int, int], None] | None = None,
    ) -> list[float]:
        """Top-1 accuracy of each point, each after its own BN recalibration on ``calibration_images`` (method §8)."""
        network = partial(self._network, calibration_images, device)
        return evaluate_points(points, network, images, labels, self.preset, device, progress)

    def _network(
        self, calibration_images: torch.Tensor, device: str | torch.device, point: OperatingPoint
    ) -> nn.Module:
        return self.point_network(point, calibration_images, device)

    def validate(self, validation: Validation, k: int, device: str | torch.device = "cpu") -> float:
        """Mean validation accuracy of the ``k`` probe points (checkpoint selection, method §8)."""
        points = self.probe_points(k)
        accs = self.evaluate(points, validation.calibration_images, validation.images, validation.labels, device)
        self.validated = [
            {"label": p.label, "macs": p.macs, "params": p.params, "val_accuracy": float(a)}
            for p, a in zip(points, accs)
        ]
        return float(sum(accs) / len(accs))

    def served(self, budget: float) -> int:
        """Index in :meth:`points` of the largest point with MACs <= ``budget`` (method §8; ValueError below the smallest)."""
        return largest_affordable_index([p.macs for p in self.points()], budget)
