"""A device's own images on the agent and the server: load_clients and load_server_data on image folders (files made here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.agent.local_data import client_budgets, load_clients
from feast_edge.cache.variants import load_cache
from feast_edge.data.holdout import content_split, holdout_split
from feast_edge.data.images import DataError, load_fashion_mnist
from feast_edge.data.sources import load_data
from feast_edge.data.task import TaskError
from feast_edge.server.held_data import load_server_data
from feast_edge.space.preset import load_preset

PRESET = load_preset("fmnist-small")
TASK = PRESET.task


def _folder(root: Path, counts: dict[str, int], size: tuple[int, int] = (32, 24)) -> Path:
    """An image folder with ``counts[class]`` PNG/JPEG files per class (flat images, a value per class and file)."""
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True)
        for i in range(n):
            pixels = np.full(size, sum(map(ord, cls)) % 200 + i % 5, np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}.{('png', 'jpg')[i % 2]}")
    return root


def _same_split(client, data, fraction: float) -> None:  # type: ignore[no-untyped-def]
    """``client`` holds out exactly the images ``content_split`` holds out of ``data``, in the folder's order."""
    train, held = content_split(data.images, data.labels, fraction)
    assert torch.equal(client.images, data.images[train]) and torch.equal(client.labels, data.labels[train])
    assert torch.equal(client.holdout_labels, data.labels[held])
    assert torch.equal(client.holdout_images.reshape(-1), data.images[held].reshape(-1))  # none held: an empty tensor


def test_an_image_folder_holds_out_a_tenth_by_content_by_default(tmp_path: Path) -> None:
    root = _folder(tmp_path / "jetson", {"Bag": 20, "Sneaker": 10, "Coat": 1})
    (client,) = load_clients(root, "jetson-1", task=TASK)
    assert client.device_id == "jetson-1" and client.budget_macs is None
    assert client.images.shape[1:] == (1, 28, 28) and client.holdout_images.shape[1:] == (1, 28, 28)
    assert client.samples + client.holdout == 31
    _same_split(client, load_data(root, TASK), 0.1)
    assert client.classes_present == (4, 7, 8)  # the task's indices, not 0, 1, 2
    assert client.source.startswith(f"image folder {root.resolve()}: 31 images in 3 classes")
    assert client.growing is not None and client.growing.fraction == 0.1  # the whole folder: the agent rescans it
    budgets = client_budgets([client], PRESET, load_cache(PRESET), 20e6)
    assert budgets == {"jetson-1": 20_000_000}


def test_holdout_and_shards_of_an_image_folder(tmp_path: Path) -> None:
    root = _folder(tmp_path / "lab", {"Trouser": 12, "Dress": 12})
    (everything,) = load_clients(root, "lab", task=TASK, holdout=0)
    assert everything.samples == 24 and everything.holdout_labels.numel() == 0
    assert everything.holdout_images.dtype == torch.uint8
    (half,) = load_clients(root, "lab", task=TASK, holdout=0.5)
    _same_split(half, load_data(root, TASK), 0.5)
    assert 0 < half.holdout < 24
    hosted = load_clients(root, "lab", clients=2, shard="1/2", task=TASK, holdout=0)
    assert [c.device_id for c in hosted] == ["lab-0", "lab-1"] and sum(c.samples for c in hosted) == 12
    assert "shard 1/2" in hosted[0].source and all(c.growing is None for c in hosted)  # a cut is read once
    cut = load_clients(root, "lab", shard="0/1", task=TASK, holdout=0.5)[0]  # a cut holds out by content too
    assert sorted(cut.holdout_images.flatten(1).sum(1).tolist()) == sorted(
        half.holdout_images.flatten(1).sum(1).tolist()
    )
    with pytest.raises(DataError, match="--holdout 0.95 must be a fraction between 0 and 0.9"):
        load_clients(root, "lab", task=TASK, holdout=0.95)
    with pytest.raises(ValueError, match="pass the federation's task"):
        load_clients(root, "lab")


def test_a_manifest_on_the_agent(tmp_path: Path) -> None:
    root = _folder(tmp_path / "imgs", {"Bag": 4})
    (tmp_path / "labels.csv").write_text("".join(f"imgs/Bag/{i}.{('png', 'jpg')[i % 2]},Shirt\n" for i in range(4)))
    (client,) = load_clients(tmp_path / "labels.csv", "pi", task=TASK)
    assert client.classes_present == (6,) and client.samples + len(client.holdout_labels) == 4
    _same_split(client, load_data(tmp_path / "labels.csv", TASK), 0.1)
    assert client.growing is not None and root.is_dir()


def test_fashion_mnist_and_shards_stay_as_today_with_no_holdout(fashion_mnist_dir: Path) -> None:
    (client,) = load_clients(fashion_mnist_dir, "lab", task=TASK)
    train = load_fashion_mnist(fashion_mnist_dir, "train")
    assert torch.equal(client.images, train.images) and torch.equal(client.labels, train.labels)
    assert client.holdout_labels.numel() == 0 and client.source == f"{fashion_mnist_dir} shard 0/1"
    (part,) = load_clients(fashion_mnist_dir, "lab", shard="3/6")
    (held,) = load_clients(fashion_mnist_dir, "lab", shard="3/6", holdout=0.1)  # asked for, it holds out here too
    train, out = holdout_split(part.labels, 0.1)
    assert torch.equal(held.images, part.images[train]) and torch.equal(held.holdout_labels, part.labels[out])
    assert 900 < len(out) < 1100


def test_a_class_folder_the_task_lacks_stops_the_agent_in_one_line(agent_cli, tmp_path: Path) -> None:
    root = _folder(tmp_path / "cam", {"Bag": 2, "Sandals": 2})
    result = agent_cli.invoke("run", "--broker", "127.0.0.1:1", "--device-id", "cam", "--data", str(root))
    agent_cli.assert_user_error(result, "folder Sandals/: class 'Sandals' is not one of the task's 10 classes")
    assert "did you mean 'Sandal'" in result.stderr
    with pytest.raises(TaskError):
        load_clients(root, "cam", task=TASK)


def test_the_server_validates_and_calibrates_on_an_image_folder(tmp_path: Path) -> None:
    root = tmp_path / "held"
    _folder(root / "train", {"Bag": 3})
    _folder(root / "test", {"Bag": 6, "Coat": 6})  # laid out by split: the server reads test/
    data = load_server_data(root, PRESET, val_samples=8, calib_samples=4)
    assert data.validation_images.shape == (8, 1, 28, 28) and data.calibration_images.shape == (4, 1, 28, 28)
    assert data.class_names == TASK.classes and sorted(set(data.validation_labels.tolist())) == [4, 8]
    assert "test" in data.source
    with pytest.raises(DataError, match=r"--val-samples \+ --calib-samples = 13 exceeds the 12 examples"):
        load_server_data(root, PRESET, val_samples=9, calib_samples=4)
    flat = _folder(tmp_path / "flat", {"Shirt": 5})  # no split folders: all of it
    assert len(load_server_data(flat, PRESET, val_samples=3, calib_samples=2).validation_labels) == 3
