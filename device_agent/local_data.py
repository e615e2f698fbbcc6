"""A device's local training data: its own images, or a shard of a data set cut by ``feast-edge partition``.

* image folder ``<root>/<class name>/<files>``, manifest CSV ``path,label``, CIFAR binary folder: the device's
  own data, read by ``feast_edge.data.sources.load_data`` with the federation's task (labels by class name,
  decoded once into the decoded cache);
* shard file (``client-007.safetensors`` from ``feast-edge partition``): one client, exactly the simulator's shard;
* partition directory (with ``index.json``): ``--clients K`` of its clients from ``--offset``, with their ids;
* Fashion-MNIST directory: its training split.

From an image folder, manifest, CIFAR or Fashion-MNIST folder, ``--shard i/N`` takes the i-th of N
deterministic shards (a permutation seeded with 0, cut into N near-equal parts) and ``--clients K``
splits that part again into K virtual clients ``ID-0..ID-(K-1)``.

Each client then holds out a deterministic share of its examples that never trains
(``feast_edge.data.holdout``): by default 10% of a device's own data (image folder, manifest, CIFAR), none of
shard files, partitions and Fashion-MNIST folders (there the server holds the validation data, and the
federation stays bit-identical to ``feast-edge simulate``). An image folder's or manifest's images are held out by
their content (``content_split``: an image never changes sides as the folder grows); the others by a per-class
draw over positions (``holdout_split``, as before).

With ``--test-split`` a further share is kept apart as a test split: never trained on and never used to decide whether
a served model is installed, only to measure each version the device receives (``feast_edge.agent.install_gate``).
It is cut after the held-out split, the same way (``content_bands``: the band above the held-out one; else a seeded
per-class draw from the training examples left). Without it (the default) every split is exactly as before.

A client that holds the whole of an image folder or manifest (no ``--shard``, one client) records where it came
from (:class:`Growing`): the agent picks up the images added to it between rounds (``feast_edge.agent.growth``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.data.decode import Progress
from feast_edge.data.holdout import TEST_SEED, check_splits, content_bands, content_split, holdout_split
from feast_edge.data.images import DataError, load_fashion_mnist
from feast_edge.data.loaded import LoadedData
from feast_edge.data.sources import GROWING, detect_kind, load_data
from feast_edge.data.task import Task
from feast_edge.sim.shards import is_partition, read_index, read_shard
from feast_edge.space.preset import Preset

SHARD_SEED = 0  # the permutation behind --shard i/N; fixed so every agent cuts the same way
OWN_DATA_HOLDOUT = 0.1  # the default held-out share of a device's own data
MAX_SHARE = 0.9  # the largest share one per-class draw takes (feast_edge.data.holdout.MAX_HOLDOUT)
_EMPTY_IMAGES = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class Growing:
    """The image folder or manifest a client holds whole, as last read: what a rescan compares and reads again."""

    path: str  # --data
    task: Task
    fraction: float  # its held-out share (content_split)
    key: str  # the listing it holds (LoadedData.key): a rescan with another key reads the folder again
    test: float = 0.0  # its test share (--test-split: content_bands)


@dataclass(frozen=True)
class LocalClient:
    """One (virtual) client hosted by an agent: its device id and data, and what its source says about it."""

    device_id: str
    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]
    budget_macs: float | None  # from a shard file; None for the device's own data
    preset: str | None  # preset name a shard was written for
    preset_digest: str | None
    source: str
    holdout_images: torch.Tensor = _EMPTY_IMAGES  # uint8 [H, C, H, W]: held out, never trains (possibly empty)
    holdout_labels: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # int64 [H]
    growing: Growing | None = None  # the folder it holds whole (None: a shard, a release, a cut of a folder)
    test_images: torch.Tensor = _EMPTY_IMAGES  # uint8: the test split (--test-split), never trained, never decides
    test_labels: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    @property
    def samples(self) -> int:
        return int(self.labels.shape[0])

    @property
    def holdout(self) -> int:
        return int(self.holdout_labels.shape[0])

    @property
    def test_samples(self) -> int:
        return int(self.test_labels.shape[0])

    @property
    def classes_present(self) -> tuple[int, ...]:
        """The task indices of the classes this client holds (training or held out), ascending."""
        return tuple(int(c) for c in torch.unique(torch.cat([self.labels, self.holdout_labels])).tolist())

    def with_holdout(
        self, fraction: float, seed: int = 0, *, by_content: bool = False, test: float = 0.0
    ) -> LocalClient:
        """This client with a per-class ``fraction`` of its examples moved to the held-out split: drawn per class over
        positions (``holdout_split``), or, ``by_content``, each example by its pixels and class (``content_split``);
        ``test``: a further share moved to the test split (see the module docstring)."""
        if test:
            return self._with_test(fraction, seed, by_content, test)
        train, held = (
            content_split(self.images, self.labels, fraction)
            if by_content
            else holdout_split(self.labels, fraction, seed)
        )
        if len(held) == 0:
            return self
        return replace(
            self,
            images=self.images[train],
            labels=self.labels[train],
            holdout_images=self.images[held],
            holdout_labels=self.labels[held],
        )

    def _with_test(self, fraction: float, seed: int, by_content: bool, test: float) -> LocalClient:
        check_splits(fraction, test)
        if by_content:
            train, held, tested = content_bands(self.images, self.labels, fraction, test)
        else:
            train, held = holdout_split(self.labels, fraction, seed)
            # Of what is left for training, the share that makes ``test`` of all the examples.
            rest, picked = holdout_split(self.labels[train], min(MAX_SHARE, test / (1 - fraction)), TEST_SEED)
            train, tested = train[rest], train[picked]
        return replace(
            self,
            images=self.images[train],
            labels=self.labels[train],
            holdout_images=self.images[held],
            holdout_labels=self.labels[held],
            test_images=self.images[tested],
            test_labels=self.labels[tested],
        )


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> (i, N) with 0 <= i < N."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise DataError(f"--shard {text!r} must be i/N with 0 <= i < N, e.g. --shard 0/4")
    return int(match.group(1)), int(match.group(2))


def _virtual_ids(device_id: str, k: int) -> list[str]:
    return [device_id] if k == 1 else [f"{device_id}-{j}" for j in range(k)]


def load_clients(
    data: str | os.PathLike[str],
    device_id: str,
    clients: int | None = None,
    shard: str | None = None,
    offset: int = 0,
    *,
    task: Task | None = None,
    holdout: float | None = None,
    progress: Progress | None = None,
    test_split: float = 0.0,
) -> list[LocalClient]:
    """The clients an agent hosts, read from ``data`` (see the module docstring).

    ``task``: the federation's task (needed for an image folder, manifest or CIFAR folder);
    ``holdout``: the held-out share of each client's examples (None: 0.1 of the device's own data, else 0);
    ``test_split``: the share of each client's examples kept apart as its test split (0: none);
    ``progress(done, total)``: called while images are decoded.
    """
    path = Path(data)
    if not path.exists():
        raise DataError(
            f"--data {path} does not exist; pass a Fashion-MNIST directory (apt-get install dataset-fashion-mnist puts it in "
            "/usr/share/datasets/fashion-mnist), an image folder <root>/<class name>/<file>, a manifest CSV (path,label), "
            "a CIFAR binary folder, or a shard file or partition directory written by 'feast-edge partition'"
        )
    if clients is not None and clients < 1:
        raise DataError(f"--clients {clients} must be at least 1")
    if path.is_file() and path.suffix.lower() != ".csv":
        if (clients or 1) != 1 or shard is not None:
            raise DataError(
                f"--data {path} is one client's shard file; --clients/--shard need a partition, image or Fashion-MNIST directory"
            )
        s = read_shard(path)
        hosted = [LocalClient(device_id, s.images, s.labels, s.budget_macs, s.preset, s.preset_digest, str(path))]
        return _held_out(hosted, holdout, 0.0, test=test_split)
    if is_partition(path):
        if shard is not None:
            raise DataError(
                "--shard cuts a Fashion-MNIST directory or a device's own images; with a partition directory choose clients with --clients and --offset"
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
        return _held_out(hosted, holdout, 0.0, test=test_split)
    kind = detect_kind(path)
    if kind == "fashion-mnist":
        train = load_fashion_mnist(path, "train")  # today's tensors exactly: the federation matches simulate
        images, labels, source, default = train.images, train.labels, "", 0.0
    else:
        if task is None:
            raise ValueError(f"load_clients: --data {path} is a {kind}; pass the federation's task (task=preset.task)")
        own = load_data(path, task, split="train", progress=progress)
        if kind in GROWING and shard is None and (clients or 1) == 1:
            fraction = _fraction(holdout, OWN_DATA_HOLDOUT)
            return [own_client(device_id, own, Growing(str(path), task, fraction, own.key, test_split))]
        images, labels, source, default = own.images, own.labels, own.source, OWN_DATA_HOLDOUT
    i, n = parse_shard(shard) if shard is not None else (0, 1)
    order = np.random.default_rng(SHARD_SEED).permutation(len(labels))
    part = np.sort(np.array_split(order, n)[i])
    k = clients or 1
    if len(part) < k:
        raise DataError(f"shard {i}/{n} of {path} holds {len(part)} examples, too few for --clients {k}")
    hosted = []
    whole = shard is None and k == 1
    where = f"{path} shard {i}/{n}" if kind == "fashion-mnist" else source if whole else f"{source}, shard {i}/{n}"
    for cid, piece in zip(_virtual_ids(device_id, k), np.array_split(part, k)):
        if whole:  # the loaded tensors themselves: a memory-mapped set stays mapped
            client_images, client_labels = images, labels
        else:
            index = torch.from_numpy(piece.astype(np.int64))
            client_images, client_labels = images[index], labels[index]
        hosted.append(LocalClient(cid, client_images, client_labels, None, None, None, where))
    return _held_out(hosted, holdout, default, by_content=kind in GROWING, test=test_split)


def own_client(device_id: str, data: LoadedData, growing: Growing) -> LocalClient:
    """The client holding the whole of an image folder or manifest, its images held out by content."""
    client = LocalClient(device_id, data.images, data.labels, None, None, None, data.source, growing=growing)
    return client.with_holdout(growing.fraction, by_content=True, test=growing.test)


def _fraction(holdout: float | None, default: float) -> float:
    return default if holdout is None else holdout


def _held_out(
    hosted: list[LocalClient], holdout: float | None, default: float, *, by_content: bool = False, test: float = 0.0
) -> list[LocalClient]:
    return [c.with_holdout(_fraction(holdout, default), by_content=by_content, test=test) for c in hosted]


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
