"""What ``feast-edge preset new --classes-from DIR`` reads of an image folder: its class names and pixel statistics.

The class names are the sorted names of the folder's sub-folders (the order
torchvision's ``ImageFolder`` uses), NFC-normalised; a folder laid out as
``ROOT/train/<class>/`` (with ``test/`` or ``val/`` beside it) is read from
``ROOT/train``. The per-channel mean and std are measured on a deterministic
sample of at most ``limit`` images spread evenly over the classes, each
turned upright, converted and resized as the task does (``Task.image_tensor``):
an estimate for the preset's normalization, at the cost of decoding ``limit``
images.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import numpy as np

from feast_edge.data.images import DataError
from feast_edge.data.task import Task, check_class_name

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SPLITS = ("train", "test", "val", "validation")


def _folders(root: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    except OSError as exc:
        raise DataError(
            f"cannot read image folder {root} ({exc.strerror}); pass a readable folder of class folders"
        ) from None


def class_folders(root: str | os.PathLike[str]) -> tuple[Path, tuple[str, ...]]:
    """The folder holding the class folders (``root`` or ``root/train``) and the sorted class names."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist; pass a folder laid out as {root}/<class name>/<images>")
    names = _folders(root)
    if "train" in names and set(names) <= set(SPLITS):
        root, names = root / "train", _folders(root / "train")
    if not names:
        raise DataError(f"image folder {root} has no sub-folders; lay out images as {root}/<class name>/<images>")
    classes = tuple(unicodedata.normalize("NFC", n) for n in names)
    for name in classes:
        check_class_name(name, f"image folder {root}")
    return root, classes


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def pixel_stats(root: Path, task: Task, limit: int = 500) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """Per-channel mean and std of pixels in [0, 1] over up to ``limit`` images of ``root/<class>/``, and how many were read."""
    from PIL import Image, UnidentifiedImageError

    per_class = [_images(root / name) for name in task.classes]
    total = sum(len(files) for files in per_class)
    if total == 0:
        raise DataError(
            f"image folder {root} holds no images ({', '.join(IMAGE_SUFFIXES)}); add images per class folder"
        )
    share = max(1, limit // len(per_class))
    sums, squares, pixels, read = np.zeros(task.channels), np.zeros(task.channels), 0, 0
    for files in per_class:
        step = max(1, len(files) // share)
        for path in files[::step][:share]:
            try:
                with Image.open(path) as image:
                    array = task.image_tensor(image).double().numpy() / 255.0
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError):
                continue  # an unreadable file does not stop an estimate
            flat = array.reshape(task.channels, -1)
            sums += flat.sum(axis=1)
            squares += (flat**2).sum(axis=1)
            pixels += flat.shape[1]
            read += 1
    if read == 0:
        raise DataError(f"no image of {root} could be read; check the files (PNG, JPEG, WebP or BMP)")
    mean = sums / pixels
    std = np.sqrt(np.maximum(squares / pixels - mean**2, 0.0))
    return tuple(float(v) for v in mean), tuple(float(max(v, 1e-3)) for v in std), read
