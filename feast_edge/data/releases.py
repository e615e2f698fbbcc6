"""The published data sets a folder may hold (Fashion-MNIST IDX, CIFAR-10/100 binary), as the task's tensors by class name.

A release's labels are mapped to the task's indices by class name
(``FASHION_MNIST_CLASSES``; CIFAR's names file or known names); a task whose
classes are named ``0``, ``1``, ... (a preset without ``class_names``) takes the
labels by index. Examples of classes the task does not have are left out and
counted. When the release's image shape is the task's, the tensors pass through
unchanged (the very tensors ``load_fashion_mnist``/``load_cifar`` return);
otherwise every image is converted by the task's policy (and cached).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from feast_edge.data.decode import Progress, open_array
from feast_edge.data.images import DataError, ImageSet, load_cifar, load_fashion_mnist
from feast_edge.data.loaded import LoadedData, decode_cached, described, report_skips
from feast_edge.data.skips import CLASS_NOT_IN_TASK, Skips
from feast_edge.data.task import Task, default_class_names

RELEASES = {"fashion-mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}
_IDX = ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte")


def detect_release(path: Path) -> str | None:
    """``fashion-mnist``, ``cifar10`` or ``cifar100`` if the folder holds that release's files, else None."""
    if any((path / f).is_file() or (path / f"{f}.gz").is_file() for f in _IDX):
        return "fashion-mnist"
    if (path / "cifar-10-batches-bin").is_dir() or (path / "data_batch_1.bin").is_file():
        return "cifar10"
    if (path / "cifar-100-binary").is_dir() or (path / "train.bin").is_file():
        return "cifar100"
    if (path / "test_batch.bin").is_file():
        return "cifar10"
    if (path / "test.bin").is_file():
        return "cifar100"
    return None


def label_lookup(names: tuple[str, ...], task: Task, where: str) -> np.ndarray:
    """Source label ``i`` -> the task's index of class ``names[i]``, -1 where the task lacks that class."""
    if task.classes == default_class_names(len(task.classes)):
        names = default_class_names(len(names))  # a task without class names takes labels by index
    lookup = np.array([task.classes.index(n) if n in task.classes else -1 for n in names], dtype=np.int64)
    if (lookup < 0).all():
        raise DataError(
            f"{where}: none of its classes ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}) is a class of "
            f"the task ({', '.join(task.classes[:5])}{', ...' if len(task.classes) > 5 else ''}); choose a matching preset"
        )
    return lookup


def _read(kind: str, path: Path, split: str) -> ImageSet:
    return load_fashion_mnist(path, split) if kind == "fashion-mnist" else load_cifar(path, kind, split)


def _key_items(folder: Path) -> list[str]:
    """Name, size, mtime and mode of every file a release's folder holds (the cache key of a converted release)."""
    items = []
    for base in (folder, *(p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith("."))):
        for entry in sorted(os.scandir(base), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                items.append(f"{base.name}/{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}")
    return items


def load_release(
    kind: str,
    path: Path,
    task: Task,
    split: str,
    *,
    cache_dir: object = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> LoadedData:
    """One split of a Fashion-MNIST or CIFAR folder as the task's tensors (see the module docstring)."""
    if split not in ("train", "test"):
        raise DataError(f"{RELEASES[kind]} has the splits train and test, not {split!r}")
    data = _read(kind, path, split)
    label = f"{RELEASES[kind]} {path} ({split} split)"
    lookup = label_lookup(data.classes, task, label)
    source_labels = data.labels.numpy()
    mapped = lookup[source_labels]
    keep = mapped >= 0
    if not keep.any():
        raise DataError(f"{label}: holds no examples of the task's classes; choose a matching preset")
    skips = Skips()
    for i in np.flatnonzero(lookup < 0):
        skips.add(CLASS_NOT_IN_TASK, data.classes[i], int((source_labels == i).sum()))
    if tuple(data.images.shape[1:]) == task.shape:
        if keep.all():
            images, labels = data.images, torch.from_numpy(mapped)
        else:
            index = torch.from_numpy(np.flatnonzero(keep))
            images, labels = data.images[index], torch.from_numpy(mapped[keep])
        report_skips(label, skips)
        return LoadedData(images, labels, task, described(label, len(labels), labels, skips), dict(skips.counts))
    pixels = data.images.numpy()
    index = np.flatnonzero(keep)
    return decode_cached(
        index,
        lambda i: open_array(pixels[i]),
        mapped[keep],
        [f"example {i}" for i in index],
        task=task,
        label=label,
        identity={"kind": kind, "path": str(path), "split": split},
        key_items=_key_items(path),
        skips=skips,
        cache_dir=cache_dir,
        workers=workers,
        progress=progress,
    )
