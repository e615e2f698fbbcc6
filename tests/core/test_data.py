"""Local data readers: Fashion-MNIST IDX (real files), CIFAR binary and simulate's image folders (files made here)."""

from __future__ import annotations

import gzip
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.data.images import CIFAR10_CLASSES, DataError, load_cifar, load_fashion_mnist
from feast_edge.data.sources import load_dataset
from feast_edge.data.task import Task
from feast_edge.space.preset import load_preset


def test_fashion_mnist_real_files(fashion_mnist_dir):
    train, test = load_fashion_mnist(fashion_mnist_dir, "train"), load_fashion_mnist(fashion_mnist_dir, "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.images.shape == (60000, 1, 28, 28) and train.images.dtype == torch.uint8
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    assert train.classes[9] == "Ankle boot"
    assert train.classes == load_preset("fmnist-small").class_names  # the preset's names are the data set's


def test_fashion_mnist_uncompressed_and_missing(fashion_mnist_dir, tmp_path):
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(fashion_mnist_dir / f"{name}.gz") as src, open(tmp_path / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    assert len(load_fashion_mnist(tmp_path, "test")) == 10000
    with pytest.raises(
        DataError, match=r"train-images-idx3-ubyte\[\.gz\] not found .* 'apt-get install dataset-fashion-mnist'"
    ):
        load_fashion_mnist(tmp_path, "train")
    with pytest.raises(DataError, match="does not exist"):
        load_fashion_mnist(tmp_path / "nope")


def test_concurrent_decompression_into_the_cache(fashion_mnist_dir, tmp_path, monkeypatch):
    """Two runs started together decompress the same .gz at once; both must get the file (a shared temp name lost one)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_copy = shutil.copyfileobj
    nested: list = []

    def copy_while_another_run_finishes(src, dst, *args):
        if not nested:  # the other run decompresses and renames its file while this one is mid-copy
            nested.append(None)
            nested[0] = load_fashion_mnist(fashion_mnist_dir, "test")
        real_copy(src, dst, *args)

    monkeypatch.setattr(shutil, "copyfileobj", copy_while_another_run_finishes)
    first = load_fashion_mnist(fashion_mnist_dir, "test")
    assert torch.equal(first.images, nested[0].images) and len(first) == 10000
    leftovers = [p.name for p in (tmp_path / "cache").rglob("*") if p.suffix == ".tmp"]
    assert leftovers == []


def _write_cifar(root, name, n, rng):
    folder, label_bytes, classes, files = {
        "cifar10": ("cifar-10-batches-bin", 1, 10, [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]),
        "cifar100": ("cifar-100-binary", 2, 100, ["train.bin", "test.bin"]),
    }[name]
    base = root / folder
    base.mkdir(parents=True)
    truth = {}
    for f in files:
        labels = rng.integers(0, classes, (n, label_bytes))
        pixels = rng.integers(0, 256, (n, 3072))
        (base / f).write_bytes(np.concatenate([labels, pixels], 1).astype(np.uint8).tobytes())
        truth[f] = (labels[:, -1], pixels.reshape(n, 3, 32, 32))
    return truth


@pytest.mark.parametrize("name, train_file", [("cifar10", "data_batch_1.bin"), ("cifar100", "train.bin")])
def test_cifar_binary(tmp_path, name, train_file):
    truth = _write_cifar(tmp_path, name, 7, np.random.default_rng(0))
    train = load_cifar(tmp_path, name, "train")
    assert train.images.shape[1:] == (3, 32, 32)
    labels, pixels = truth[train_file]
    assert train.labels[:7].tolist() == labels.tolist()  # CIFAR-100: the fine label
    assert torch.equal(train.images[:7], torch.from_numpy(pixels.astype(np.uint8)))
    assert len(load_dataset(name, tmp_path, "test", load_preset("paper-cinic10").task)) == 7
    expected = CIFAR10_CLASSES if name == "cifar10" else load_preset("paper-cifar100").class_names
    assert train.classes == expected  # no names file: the known names


def test_cifar_names_file(tmp_path):
    _write_cifar(tmp_path, "cifar10", 2, np.random.default_rng(0))
    names = [f"thing{i}" for i in range(10)]
    (tmp_path / "cifar-10-batches-bin" / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    assert load_cifar(tmp_path, "cifar10", "test").classes == tuple(names)
    (tmp_path / "cifar-10-batches-bin" / "batches.meta.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match="lists 2 class names, cifar10 has 10"):
        load_cifar(tmp_path, "cifar10", "test")


def test_cifar_missing_and_truncated(tmp_path):
    with pytest.raises(DataError, match="binary files .* not found"):
        load_cifar(tmp_path, "cifar10")
    _write_cifar(tmp_path, "cifar10", 2, np.random.default_rng(0))
    path = tmp_path / "cifar-10-batches-bin" / "test_batch.bin"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(DataError, match="truncated"):
        load_cifar(tmp_path, "cifar10", "test")


def test_simulate_image_folder_labels_by_name(tmp_path, monkeypatch):
    """train/ and test/ holding different classes agree on every class's index (ImageFolder numbered each folder's own)."""
    monkeypatch.setenv("FEAST_EDGE_DATA_CACHE", str(tmp_path / "cache"))
    task = Task(1, 28, ("ant", "bee", "cat"), (0.5,), (0.5,))
    for split, classes in (("train", ("ant", "bee", "cat")), ("test", ("bee", "cat"))):
        for cls in classes:
            (tmp_path / split / cls).mkdir(parents=True)
            value = 10 + 100 * task.classes.index(cls)
            for i in range(2):
                Image.fromarray(np.full((40, 50, 3), value, np.uint8)).save(tmp_path / split / cls / f"{i}.png")
    train, test = (load_dataset("imagefolder", tmp_path, split, task) for split in ("train", "test"))
    assert train.images.shape == (6, 1, 28, 28) and train.classes == test.classes == task.classes
    assert train.labels.tolist() == [0, 0, 1, 1, 2, 2] and test.labels.tolist() == [1, 1, 2, 2]
    assert test.images[:, 0, 0, 0].tolist() == [110, 110, 210, 210]  # bee is 1 in both, and bee's pixels
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("imagefolder", tmp_path, "val", task)


def test_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match="unknown data set 'mnist2'"):
        load_dataset("mnist2", tmp_path, "train", load_preset("fmnist-small").task)
