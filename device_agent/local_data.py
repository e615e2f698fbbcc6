"""A device's local training data: a shard file, a partition directory, or a Fashion-MNIST IDX directory.

* shard file (``client-007.safetensors`` from ``feast-edge partition``): one client, exactly the simulator's shard;
* partition directory (with ``index.json``): ``--clients K`` of its clients from ``--offset``, with their ids;
* Fashion-MNIST directory: its training split, or with ``--shard i/N`` the i-th of N deterministic
  shards (a permutation seeded with 0, cut into N near-equal parts); ``--clients K`` splits that part
  again into K virtual clients ``ID-0..ID-(K-1)``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.data.images import DataError, load_fashion_mnist
from feast_edge.sim.shards import is_partition, read_index, read_shard
from feast_edge.space.preset import Preset

SHARD_SEED = 0  # the permutation behind --shard i/N; fixed so every agent cuts the same way


@dataclass(frozen=True)
class LocalClient:
    """One (virtual) client hosted by an agent: its device id and data, and what its source says about it."""

    device_id: str
    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]
    budget_macs: float | None  # from a shard file; None for IDX data
    preset: str | None  # preset name a shard was written for
    preset_digest: str | None
    source: str
    holdout_images: torch.Tensor = torch.empty(0, dtype=torch.uint8)  # the held-out split: never trains
    holdout_labels: torch.Tensor = torch.empty(0, dtype=torch.long)

    @property
    def samples(self) -> int:
        return int(self.labels.shape[0])

    @property
    def holdout(self) -> int:
        return int(self.holdout_labels.shape[0])


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> (i, N) with 0 <= i < N."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise DataError(f"--shard {text!r} must be i/N with 0 <= i < N, e.g. --shard 0/4")
    return int(match.group(1)), int(match.group(2))


def _virtual_ids(device_id: str, k: int) -> list[str]:
    return [device_id] if k == 1 else [f"{device_id}-{j}" for j in range(k)]


def load_clients(
    data: str | os.PathLike[str], device_id: str, clients: int | None = None, shard: str | None = None, offset: int = 0
) -> list[LocalClient]:
    """The clients an agent hosts, read from ``data`` (see the module docstring)."""
    path = Path(data)
    if not path.exists():
        raise DataError(
            f"--data {path} does not exist; pass a Fashion-MNIST directory (apt-get install dataset-fashion-mnist puts it in "
            "/usr/share/datasets/fashion-mnist), a shard file or a partition directory written by 'feast-edge partition'"
        )
    if clients is not None and clients < 1:
        raise DataError(f"--clients {clients} must be at least 1")
    if path.is_file():
        if (clients or 1) != 1 or shard is not None:
            raise DataError(
                f"--data {path} is one client's shard file; --clients/--shard need a partition or Fashion-MNIST directory"
            )
        s = read_shard(path)
        return [LocalClient(device_id, s.images, s.labels, s.budget_macs, s.preset, s.preset_digest, str(path))]
    if is_partition(path):
        if shard is not None:
            raise DataError(
                "--shard cuts a Fashion-MNIST directory; with a partition directory choose clients with --clients and --offset"
            )
        entries = read_index(path)["clients"]
        count = len(entries) - offset if clients is None else clients
        if offset < 0 or count < 1 or offset + count > len(entries):
            raise DataError(
                f"--offset {offset} --clients {count} is outside the {len(entries)} clients of partition {path}"
            )
        hosted = []
        for entry in entries[offset : offset + count]:
            s = read_shard(path / str(entry["file"]))
            hosted.append(
                LocalClient(
                    s.client_id,
                    s.images,
                    s.labels,
                    s.budget_macs,
                    s.preset,
                    s.preset_digest,
                    str(path / str(entry["file"])),
                )
            )
        return hosted
    train = load_fashion_mnist(path, "train")
    i, n = parse_shard(shard) if shard is not None else (0, 1)
    order = np.random.default_rng(SHARD_SEED).permutation(len(train))
    part = np.sort(np.array_split(order, n)[i])
    k = clients or 1
    if len(part) < k:
        raise DataError(f"shard {i}/{n} of {path} holds {len(part)} examples, too few for --clients {k}")
    hosted = []
    for cid, piece in zip(_virtual_ids(device_id, k), np.array_split(part, k)):
        index = torch.from_numpy(piece.astype(np.int64))
        hosted.append(
            LocalClient(cid, train.images[index], train.labels[index], None, None, None, f"{path} shard {i}/{n}")
        )
    return hosted


def client_budgets(
    clients: list[LocalClient], preset: Preset, cache: VariantCache, budget_macs: float | None
) -> dict[str, int]:
    """Each hosted client's MAC budget (``budget_macs`` for all, else its shard's), after checking its data fits ``preset``.

    DataError names the client, the problem and the fix (preset, shape, labels, missing or too small budget, duplicate id).
    """
    if not clients:
        raise DataError("the agent hosts no clients; check --data and --clients")
    shape = (preset.in_channels, preset.input_size, preset.input_size)
    budgets: dict[str, int] = {}
    for c in clients:
        if c.preset_digest is not None and c.preset_digest != preset.digest:
            raise DataError(
                f"{c.source} was partitioned for preset {c.preset!r}, but the agent trains {preset.name!r}; pass --preset {c.preset}"
            )
        if tuple(c.images.shape[1:]) != shape:
            raise DataError(
                f"{c.source}: images are {tuple(c.images.shape[1:])}, preset {preset.name} takes {shape}; pass matching --data or --preset"
            )
        if c.samples and int(c.labels.max()) >= preset.classes:
            raise DataError(
                f"{c.source}: labels reach {int(c.labels.max())}, preset {preset.name} has {preset.classes} classes"
            )
        budget = budget_macs if budget_macs is not None else c.budget_macs
        if budget is None:
            raise DataError(
                f"no MAC budget for device {c.device_id}: pass --budget MACS or --profile NAME|FILE (a shard file carries its own)"
            )
        if budget < cache.smallest.macs:
            raise DataError(cache.below_smallest(budget, "raise --budget or use a profile of a stronger device"))
        if c.device_id in budgets:
            raise DataError(f"device id {c.device_id} appears twice among the hosted clients")
        budgets[c.device_id] = int(budget)
    return budgets
