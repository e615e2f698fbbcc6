"""Local data sets, read from disk only (nothing is ever downloaded).

Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` package
(``/usr/share/datasets/fashion-mnist``: the original IDX files, optionally
gzipped) and is parsed with torchvision's IDX reader.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torchvision.datasets.mnist import read_image_file, read_label_file

from feast_edge.errors import FeastError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class DataError(FeastError):
    """A data set is missing or malformed."""


@dataclass(frozen=True)
class ImageSet:
    """Images as uint8 ``[N, C, H, W]`` with int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def floats(self, index: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Pixels scaled to [0, 1] as float32."""
        images = self.images if index is None else self.images[index]
        return images.float().div_(255.0)


def normalize(pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(pixels - mean) / std`` per channel for ``[N, C, H, W]`` pixels in [0, 1]."""
    shape = (1, -1, 1, 1)
    return (pixels - pixels.new_tensor(mean).view(shape)) / pixels.new_tensor(std).view(shape)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "feast-edge" / "idx"


def _idx_file(root: Path, name: str) -> Path:
    """Path of an uncompressed IDX file, decompressing ``name.gz`` into the user cache if needed."""
    plain = root / name
    if plain.is_file():
        return plain
    packed = root / f"{name}.gz"
    if not packed.is_file():
        raise DataError(
            f"Fashion-MNIST file {name}[.gz] not found in {root}; install the data set with "
            f"'apt-get install dataset-fashion-mnist' (it goes to {FASHION_MNIST_DIR}) or pass the directory that holds the IDX files"
        )
    stat = packed.stat()
    key = hashlib.sha256(f"{packed.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = _cache_dir() / key / name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        try:
            with gzip.open(packed, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (OSError, EOFError) as exc:
            raise DataError(f"Fashion-MNIST file {packed} is corrupt ({exc}); reinstall the data set") from None
        os.replace(tmp, target)
    return target


def load_fashion_mnist(root: str | os.PathLike[str] = FASHION_MNIST_DIR, split: str = "train") -> ImageSet:
    """Fashion-MNIST ``train`` (60,000) or ``test`` (10,000) split from a local directory."""
    if split not in _FILES:
        raise DataError(f"unknown Fashion-MNIST split {split!r}; use 'train' or 'test'")
    root = Path(root)
    if not root.is_dir():
        raise DataError(
            f"Fashion-MNIST directory {root} does not exist; install the data set with "
            f"'apt-get install dataset-fashion-mnist' or pass the directory that holds the IDX files"
        )
    image_name, label_name = _FILES[split]
    try:
        images = read_image_file(str(_idx_file(root, image_name)))
        labels = read_label_file(str(_idx_file(root, label_name)))
    except (AssertionError, RuntimeError, ValueError) as exc:
        raise DataError(f"Fashion-MNIST files in {root} are not valid IDX files ({exc}); reinstall the data set") from None
    if images.shape[0] != labels.shape[0] or images.shape[1:] != (28, 28):
        raise DataError(f"Fashion-MNIST files in {root} disagree (images {tuple(images.shape)}, labels {tuple(labels.shape)}); reinstall the data set")
    return ImageSet(images.unsqueeze(1).contiguous(), labels.long(), FASHION_MNIST_CLASSES)
