"""Server-held data: the validation split for model selection and the BN-calibration split for export (method §4, §8)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from feast_edge.data.images import DataError, load_fashion_mnist
from feast_edge.data.sources import detect_kind, load_data
from feast_edge.sim.shards import is_partition, read_index, read_server_split
from feast_edge.space.preset import Preset


@dataclass(frozen=True)
class ServerData:
    """Validation images/labels and calibration images, uint8 ``[N, C, H, W]``; never sent to devices."""

    validation_images: torch.Tensor
    validation_labels: torch.Tensor
    calibration_images: torch.Tensor
    class_names: tuple[str, ...] | None
    source: str
    shard_samples: dict[str, int] = field(
        default_factory=dict
    )  # client id -> training examples, from a partition's index

    def describe(self) -> str:
        return f"{len(self.validation_labels)} validation + {len(self.calibration_images)} calibration examples from {self.source}"


def load_server_data(
    path: str | os.PathLike[str], preset: Preset, val_samples: int = 5000, calib_samples: int = 500
) -> ServerData:
    """A partition directory's held-out server split, the first examples of a Fashion-MNIST directory's *test* split,
    or ``val_samples`` + ``calib_samples`` examples of an image folder, manifest or CIFAR folder.

    Agents given a Fashion-MNIST directory train on its training split, so the
    server's examples come from the test split: the two can never overlap. An
    image folder laid out by split (``train/``, ``test/``) and a CIFAR folder give
    their test split, any other image folder or manifest all of its examples;
    they are labelled by the task's class names and drawn in a permutation seeded
    with 0 (validation first, then calibration), so every class can be in both.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"--data {path} does not exist; pass a partition directory written by 'feast-edge partition' or a Fashion-MNIST "
            "directory (install it with 'apt-get install dataset-fashion-mnist')"
        )
    if is_partition(path):
        index = read_index(path)
        if index.get("preset_digest") != preset.digest:
            raise DataError(
                f"--data {path} was partitioned for preset {index.get('preset')!r}, this server trains {preset.name!r}; partition again with --preset {preset.name}"
            )
        split = read_server_split(path)
        names = preset.task.classes
        shards = {str(c["client_id"]): int(c.get("samples", 0)) for c in index["clients"]}
        return ServerData(
            split.validation_images,
            split.validation_labels,
            split.calibration_images,
            names,
            f"partition {path}",
            shards,
        )
    if val_samples < 1 or calib_samples < 1:
        raise DataError("--val-samples and --calib-samples must be at least 1")
    if detect_kind(path) != "fashion-mnist":
        return _own_data(path, preset, val_samples, calib_samples)
    if (preset.in_channels, preset.input_size) != (1, 28):
        raise DataError(
            f"--data {path} is read as Fashion-MNIST (1x28x28) but preset {preset.name} takes {preset.in_channels}x{preset.input_size}x{preset.input_size}; pass a partition directory"
        )
    test = load_fashion_mnist(path, "test")
    if val_samples + calib_samples > len(test):
        raise DataError(
            f"--val-samples + --calib-samples = {val_samples + calib_samples} exceeds the {len(test)} test examples of {path}; hold out fewer"
        )
    return ServerData(
        test.images[:val_samples],
        test.labels[:val_samples],
        test.images[val_samples : val_samples + calib_samples],
        preset.task.classes,
        f"the test split of {path}",
    )


def _own_data(path: Path, preset: Preset, val_samples: int, calib_samples: int) -> ServerData:
    data = load_data(path, preset.task, split="test")
    if val_samples + calib_samples > len(data):
        raise DataError(
            f"--val-samples + --calib-samples = {val_samples + calib_samples} exceeds the {len(data)} examples of "
            f"{data.source}; hold out fewer (e.g. --val-samples {max(1, len(data) * 9 // 10)} --calib-samples "
            f"{max(1, len(data) - len(data) * 9 // 10)})"
        )
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(data)))
    val, calib = order[:val_samples], order[val_samples : val_samples + calib_samples]
    return ServerData(
        data.images[val],
        data.labels[val],
        data.images[calib],
        preset.task.classes,
        data.source,
    )
