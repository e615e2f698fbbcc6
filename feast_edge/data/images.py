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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from feast_edge.errors import FeastError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST's classes in its label order; 'T-shirt/top' is 'T-shirt_top', as a class name is also a folder name
# (equal to the fmnist-small preset's class_names).
FASHION_MNIST_CLASSES = (
    "T-shirt_top",
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
        # A private temporary name: runs started together may decompress the same file at once.
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=target.parent)
        try:
            with gzip.open(packed, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (OSError, EOFError) as exc:
            Path(tmp).unlink(missing_ok=True)
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
    # Imported here: torchvision's import costs every command about two seconds, and only this loader needs it.
    from torchvision.datasets.mnist import read_image_file, read_label_file

    try:
        images = read_image_file(str(_idx_file(root, image_name)))
        labels = read_label_file(str(_idx_file(root, label_name)))
    except (AssertionError, RuntimeError, ValueError) as exc:
        raise DataError(
            f"Fashion-MNIST files in {root} are not valid IDX files ({exc}); reinstall the data set"
        ) from None
    if images.shape[0] != labels.shape[0] or images.shape[1:] != (28, 28):
        raise DataError(
            f"Fashion-MNIST files in {root} disagree (images {tuple(images.shape)}, labels {tuple(labels.shape)}); reinstall the data set"
        )
    return ImageSet(images.unsqueeze(1).contiguous(), labels.long(), FASHION_MNIST_CLASSES)


# ----------------------------------------------------------------------------- CIFAR (binary version)

_CIFAR = {
    # name: (directory inside root, train files, test files, label bytes, label offset, classes)
    "cifar10": ("cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)], ["test_batch.bin"], 1, 0, 10),
    "cifar100": ("cifar-100-binary", ["train.bin"], ["test.bin"], 2, 1, 100),
}


def load_cifar(root: str | os.PathLike[str], name: str, split: str = "train") -> ImageSet:
    """CIFAR-10/100 from the official *binary* release (no pickle is ever read).

    ``root`` holds ``cifar-10-batches-bin/`` or ``cifar-100-binary/`` (or is that
    directory itself). CIFAR-100 uses its fine labels.
    """
    if name not in _CIFAR:
        raise DataError(f"unknown CIFAR variant {name!r}; use 'cifar10' or 'cifar100'")
    if split not in ("train", "test"):
        raise DataError(f"unknown CIFAR split {split!r}; use 'train' or 'test'")
    folder, train_files, test_files, label_bytes, label_at, classes = _CIFAR[name]
    root = Path(root)
    base = root / folder if (root / folder).is_dir() else root
    files = [base / f for f in (train_files if split == "train" else test_files)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(
            f"{name} binary files {', '.join(missing)} not found in {base}; download the *binary* release "
            f"({folder}) on a machine with network access, unpack it under {root}, and pass that directory "
            "(the pickled 'python' release is not read)"
        )
    record = label_bytes + 3 * 32 * 32
    raw = b"".join(f.read_bytes() for f in files)
    if len(raw) % record:
        raise DataError(
            f"{name} files in {base} are truncated ({len(raw)} bytes is not a multiple of {record}); re-extract them"
        )
    rows = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, record)
    labels = rows[:, label_at].long()
    images = rows[:, label_bytes:].reshape(-1, 3, 32, 32).contiguous()
    return ImageSet(images, labels, cifar_class_names(base, name, classes))


def published_splits(root: str | os.PathLike[str], name: str) -> tuple[str, ...]:
    """The splits (``train``, ``test``) of the Fashion-MNIST, CIFAR-10 or CIFAR-100 release ``name`` whose files
    ``root`` holds: its images file (Fashion-MNIST) or any of its batch files (CIFAR); reading a split whose other
    files are missing names them."""
    root = Path(root)
    if name == "fashion-mnist":
        present = {
            s for s, (images, _) in _FILES.items() if (root / images).is_file() or (root / f"{images}.gz").is_file()
        }
    elif name in _CIFAR:
        folder, train_files, test_files, *_ = _CIFAR[name]
        base = root / folder if (root / folder).is_dir() else root
        present = {
            s for s, files in (("train", train_files), ("test", test_files)) if any((base / f).is_file() for f in files)
        }
    else:
        raise DataError(f"unknown release {name!r}; use 'fashion-mnist', 'cifar10' or 'cifar100'")
    return tuple(s for s in ("train", "test") if s in present)


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_NAME_FILES = {"cifar10": "batches.meta.txt", "cifar100": "fine_label_names.txt"}


def cifar_class_names(base: Path, name: str, count: int) -> tuple[str, ...]:
    """The class names of a CIFAR binary release: its names file (batches.meta.txt, fine_label_names.txt) when present.

    Without the file: CIFAR-10's known names, or CIFAR-100's from the paper-cifar100 preset.
    """
    path = base / _NAME_FILES[name]
    if path.is_file():
        try:
            names = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read {path} ({exc}); re-extract the {name} release") from None
        if len(names) != count:
            raise DataError(f"{path} lists {len(names)} class names, {name} has {count}; re-extract the release")
        return names
    if name == "cifar10":
        return CIFAR10_CLASSES
    from feast_edge.space.preset import load_preset

    return load_preset("paper-cifar100").class_names
