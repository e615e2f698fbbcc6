"""load_data: a device's images in every layout, as the task's tensors, labelled by class name (files written here)."""

from __future__ import annotations

import dataclasses
import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.data.images import DataError, load_cifar, load_fashion_mnist
from feast_edge.data.skips import CLASS_NOT_IN_TASK
from feast_edge.data.sources import detect_kind, load_data, splits_of
from feast_edge.data.task import Task, TaskError
from feast_edge.space.preset import load_preset

FMNIST = load_preset("fmnist-small").task
RGB = Task(3, 16, ("ant", "bee", "cat", "dog"), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("cache")  # outside tmp_path, which the tests lay out as image folders
    monkeypatch.setenv("FEAST_EDGE_DATA_CACHE", str(folder))
    return folder


def _save(path: Path, pixels: np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt)
    return path


def _flat(value: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, value, np.uint8)


def test_every_format_grey_and_rgb_any_size_nested_and_hidden_ignored(tmp_path: Path) -> None:
    root = tmp_path / "device"
    files = {
        "ant/a.png": _flat(40, (20, 30)),  # grey PNG
        "ant/deep/er/b.JPG": _flat(40, (64, 48, 3)),  # RGB JPEG, upper-case extension, nested
        "bee/c.webp": _flat(120, (16, 16, 3)),
        "bee/d.bmp": _flat(120, (9, 33)),
        "bee/e.jpeg": _flat(120, (50, 50)),
        "cat/f.PNG": _flat(200, (17, 16, 3)),
    }
    for name, pixels in files.items():
        _save(root / name, pixels, "WEBP" if name.endswith("webp") else None)
    _save(root / ".hidden" / "x.png", _flat(0, (4, 4)))  # a hidden folder is not a class
    _save(root / "ant" / ".thumb.png", _flat(0, (4, 4)))  # a hidden file is not an image
    data = load_data(root, RGB)
    assert data.images.shape == (6, 3, 16, 16) and data.images.dtype == torch.uint8
    assert data.labels.dtype == torch.int64 and data.labels.tolist() == [0, 0, 1, 1, 1, 2]
    means = data.images.float().mean(dim=(1, 2, 3)).round().tolist()
    assert means == [40, 40, 120, 120, 120, 200]  # grey spread to RGB; JPEG/WebP keep a flat colour within 1
    assert data.class_counts() == {"ant": 2, "bee": 3, "cat": 1} and data.skipped == {}
    assert data.source == f"image folder {root.resolve()}: 6 images in 3 classes" and not data.from_cache
    assert detect_kind(root) == "image folder"


def test_two_devices_with_different_classes_agree_on_every_index(tmp_path: Path) -> None:
    """Labels by class name: each device gets the task's indices, not the sorted order of its own folders."""
    for device, classes in (("jetson", ("Trouser", "Bag", "Coat")), ("laptop", ("Bag", "Sneaker"))):
        for cls in classes:
            _save(tmp_path / device / cls / "0.png", _flat(10 * FMNIST.index_of(cls), (28, 28)))
    a, b = load_data(tmp_path / "jetson", FMNIST), load_data(tmp_path / "laptop", FMNIST)
    assert sorted(a.labels.tolist()) == [1, 4, 8] and sorted(b.labels.tolist()) == [7, 8]
    for data in (a, b):  # each image carries its class's own value
        assert [int(img.max()) for img in data.images] == [10 * int(y) for y in data.labels]
    assert a.class_counts() == {"Trouser": 1, "Coat": 1, "Bag": 1}


def test_a_class_folder_the_task_lacks_names_the_closest_classes(tmp_path: Path) -> None:
    _save(tmp_path / "sneaker" / "0.png", _flat(1, (8, 8)))
    with pytest.raises(TaskError, match=r"folder sneaker/: class 'sneaker' is not one of .* did you mean 'Sneaker'"):
        load_data(tmp_path, FMNIST)
    for extra in ("zebra", "Trouser", "yak"):
        _save(tmp_path / extra / "0.png", _flat(1, (8, 8)))
    with pytest.raises(TaskError, match=r"remove it \(nor are yak/, zebra/\)$"):  # all of them in the one line
        load_data(tmp_path, FMNIST)


def test_a_root_laid_out_by_split_gives_each_split_with_the_same_indices(tmp_path: Path) -> None:
    for split, classes in (("train", ("ant", "bee", "cat")), ("test", ("bee", "cat"))):
        for cls in classes:
            _save(tmp_path / split / cls / "0.png", _flat(50 * RGB.index_of(cls), (16, 16, 3)))
    train, test = load_data(tmp_path, RGB), load_data(tmp_path, RGB, split="test")
    assert train.labels.tolist() == [0, 1, 2] and test.labels.tolist() == [1, 2]
    assert torch.equal(train.images[1:], test.images)
    assert "train" in train.source and "test" in test.source
    with pytest.raises(DataError, match=r"laid out by split \(test/, train/\) but has no val/"):
        load_data(tmp_path, RGB, split="val")
    with pytest.raises(DataError, match="unknown split 'dev'"):
        load_data(tmp_path, RGB, split="dev")


def test_a_manifest_with_header_relative_and_absolute_paths(tmp_path: Path) -> None:
    _save(tmp_path / "img" / "x.png", _flat(10, (16, 16, 3)))
    _save(tmp_path / "img" / "y.jpg", _flat(90, (20, 12, 3)))
    absolute = _save(tmp_path / "elsewhere" / "z.bmp", _flat(170, (16, 16, 3)))
    manifest = tmp_path / "labels.csv"
    manifest.write_text(f"path,label\nimg/x.png,dog\n\nimg/y.jpg, ant\n{absolute},dog\nimg/x.png,cat\n")
    data = load_data(manifest, RGB)
    assert data.labels.tolist() == [3, 0, 3, 2]  # in the rows' order, duplicates kept
    assert data.images.float().mean(dim=(1, 2, 3)).round().tolist() == [10, 90, 170, 10]
    assert data.source.startswith(f"manifest {manifest.resolve()}: 4 images in 3 classes")
    no_header = tmp_path / "plain.csv"
    no_header.write_text("img/x.png,bee\n")
    assert load_data(no_header, RGB).labels.tolist() == [1]


def test_integer_labels_work_where_the_preset_names_no_classes(tmp_path: Path) -> None:
    unnamed = dataclasses.replace(load_preset("paper-tinyimagenet"), class_names=())
    task = unnamed.task  # no class_names: "0" .. "199"
    _save(tmp_path / "a.png", _flat(5, (64, 64, 3)))
    (tmp_path / "m.csv").write_text("a.png,17\na.png,199\n")
    assert load_data(tmp_path / "m.csv", task).labels.tolist() == [17, 199]


def test_fashion_mnist_passes_through_bit_identical(fashion_mnist_dir: Path) -> None:
    data = load_data(fashion_mnist_dir, FMNIST, split="test")
    reference = load_fashion_mnist(fashion_mnist_dir, "test")
    assert data.images is reference.images or torch.equal(data.images, reference.images)
    assert torch.equal(data.labels, reference.labels) and data.labels.dtype == reference.labels.dtype
    assert data.skipped == {} and detect_kind(fashion_mnist_dir) == "fashion-mnist"


def test_a_release_maps_by_name_and_counts_classes_the_task_lacks(fashion_mnist_dir: Path, tmp_path: Path) -> None:
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        shutil.copy(fashion_mnist_dir / f"{name}.gz", tmp_path / f"{name}.gz")
    reference = load_fashion_mnist(tmp_path, "test")
    task = Task(3, 28, ("Bag", "Dress", "zebra"), (0.5,) * 3, (0.5,) * 3)  # a subset, reordered, in RGB
    data = load_data(tmp_path, task, split="test", workers=2)
    assert len(data) == 2000 and data.skipped == {CLASS_NOT_IN_TASK: 8000}
    assert data.class_counts() == {"Bag": 1000, "Dress": 1000}
    bags = reference.images[reference.labels == 8]
    assert data.images.shape == (2000, 3, 28, 28)
    # Converted by the task's policy: each grey image spread to RGB, its pixels unchanged.
    first = data.images[data.labels == 0][0]
    assert torch.equal(first[0], bags[0, 0]) and torch.equal(first[0], first[2])
    again = load_data(tmp_path, task, split="test")
    assert again.from_cache and torch.equal(again.images, data.images) and again.skipped == data.skipped


def test_cifar_is_named_and_passes_through(tmp_path: Path) -> None:
    base = tmp_path / "cifar-10-batches-bin"
    base.mkdir()
    rng = np.random.default_rng(0)
    for f in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        rows = np.concatenate([rng.integers(0, 10, (6, 1)), rng.integers(0, 256, (6, 3072))], 1)
        (base / f).write_bytes(rows.astype(np.uint8).tobytes())
    task = load_preset("paper-cinic10").task  # CIFAR-10's names in CIFAR-10's order
    data, reference = load_data(tmp_path, task), load_cifar(tmp_path, "cifar10")
    assert detect_kind(tmp_path) == "cifar10" and len(data) == 30
    assert torch.equal(data.images, reference.images) and torch.equal(data.labels, reference.labels)
    shuffled = Task(3, 32, ("truck", "airplane"), (0.5,) * 3, (0.5,) * 3)
    subset, test = load_data(tmp_path, shuffled, split="test"), load_cifar(tmp_path, "cifar10", "test").labels.tolist()
    assert subset.labels.tolist() == [0 if y == 9 else 1 for y in test if y in (0, 9)]
    assert subset.skipped == {CLASS_NOT_IN_TASK: sum(y not in (0, 9) for y in test)}


def test_the_splits_a_source_holds_are_the_ones_its_files_or_folders_hold(tmp_path: Path) -> None:
    cifar = tmp_path / "cifar" / "cifar-10-batches-bin"
    cifar.mkdir(parents=True)
    (cifar / "test_batch.bin").write_bytes(bytes(3073))
    assert splits_of(tmp_path / "cifar", RGB) == ("test",)  # the test batch alone: no train split
    (cifar / "data_batch_1.bin").write_bytes(bytes(3073))
    assert splits_of(tmp_path / "cifar", RGB) == ("train", "test")
    for split in ("test", "train"):
        _save(tmp_path / "by-split" / split / RGB.classes[0] / "a.png", _flat(5, (8, 8, 3)))
    assert splits_of(tmp_path / "by-split", RGB) == ("train", "test")
    assert splits_of(tmp_path / "by-split" / "test", RGB) == ()  # class folders: one split, read whole
    (tmp_path / "m.csv").write_text(f"by-split/test/{RGB.classes[0]}/a.png,{RGB.classes[0]}\n")
    assert splits_of(tmp_path / "m.csv", RGB) == ()


def test_decoding_in_threads_equals_decoding_in_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for i in range(40):
        size = (int(rng.integers(8, 40)), int(rng.integers(8, 40)), 3)
        _save(
            tmp_path / "d" / RGB.classes[i % 4] / f"{i}.{('png', 'jpg')[i % 2]}", rng.integers(0, 256, size, np.uint8)
        )
    calls: list[tuple[int, int]] = []
    one = load_data(tmp_path / "d", RGB, workers=1, cache_dir=False)
    many = load_data(tmp_path / "d", RGB, workers=3, cache_dir=False, progress=lambda d, t: calls.append((d, t)))
    assert torch.equal(one.images, many.images) and torch.equal(one.labels, many.labels)
    assert calls[-1] == (40, 40) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_what_is_not_a_source_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "shard.safetensors").write_bytes(b"x")
    with pytest.raises(DataError, match="does not exist; pass an image folder"):
        load_data(tmp_path / "nowhere", RGB)
    with pytest.raises(DataError, match="is a file, not a manifest"):
        load_data(tmp_path / "notes.txt", RGB)
    with pytest.raises(DataError, match="is a shard file"):
        load_data(tmp_path / "shard.safetensors", RGB)


def test_gzipped_idx_and_a_plain_image_folder_are_told_apart(fashion_mnist_dir: Path, tmp_path: Path) -> None:
    with gzip.open(fashion_mnist_dir / "t10k-labels-idx1-ubyte.gz") as src:
        (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(src.read())
    assert detect_kind(tmp_path) == "image folder"  # labels alone are no Fashion-MNIST folder
    with pytest.raises(DataError, match="holds no class folders"):
        load_data(tmp_path, FMNIST)


def test_simulate_builds_on_an_image_folder(tmp_path: Path) -> None:
    from feast_edge.sim.setup import SimulationConfig, build_setup

    rng = np.random.default_rng(0)
    for split, classes, n in (("train", ("Trouser", "Coat", "Bag"), 30), ("test", ("Bag",), 4)):
        for cls in classes:
            for i in range(n):
                _save(tmp_path / split / cls / f"{i}.png", rng.integers(0, 256, (28, 28), np.uint8))
    config = SimulationConfig.of(
        dataset="imagefolder", data_dir=str(tmp_path), clients=2, per_round=1, rounds=1, val_samples=10, calib_samples=5
    )
    setup = build_setup(config)
    assert sorted(set(setup.train_set.labels.tolist())) == [1, 4, 8] and setup.test_set.labels.tolist() == [8] * 4
    assert setup.train_set.classes == FMNIST.classes and len(setup.pool) == 75
    images, labels = setup.client_data("client-000")
    assert images.shape[1:] == (1, 28, 28) and set(labels.tolist()) <= {1, 4, 8}
