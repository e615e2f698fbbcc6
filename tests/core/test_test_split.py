"""The test split (``feast-agent run --test-split``): apart from the training and held-out splits, stable as a folder
grows (the band above the held-out one of the same content draw), a seeded per-class draw elsewhere, and nothing moves
where it is off or when it is added (feast_edge.data.holdout.content_bands, LocalClient.with_holdout)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.agent.local_data import LocalClient, load_clients, own_client
from feast_edge.data.holdout import content_bands, content_draws, content_split
from feast_edge.data.images import DataError
from feast_edge.data.sources import load_data
from feast_edge.data.task import Task

TASK = Task(1, 8, ("ant", "bee", "cat"), (0.5,), (0.25,))


def _write(root: Path, start: int, count: int) -> None:
    """``count`` distinct tiny images, numbered from ``start``, spread over the task's classes."""
    for i in range(start, start + count):
        pixels = np.random.default_rng(i).integers(0, 256, (8, 8), np.uint8)
        path = root / TASK.classes[i % 3] / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path)


def _keys(images: torch.Tensor) -> set[bytes]:
    return {bytes(x.numpy().tobytes()) for x in images}


def test_every_image_keeps_its_side_of_the_three_splits_as_the_folder_grows(tmp_path: Path) -> None:
    root = tmp_path / "cam"
    before: dict[str, set[bytes]] = {"train": set(), "held": set(), "test": set()}
    for start, count in [(0, 30), (30, 9), (39, 50), (89, 1), (90, 60)]:
        _write(root, start, count)
        (client,) = load_clients(root, "cam", task=TASK, holdout=0.3, test_split=0.2)
        now = {"train": _keys(client.images), "held": _keys(client.holdout_images), "test": _keys(client.test_images)}
        assert sum(map(len, now.values())) == start + count
        assert not (now["train"] & now["held"] or now["train"] & now["test"] or now["held"] & now["test"])
        assert all(before[side] <= now[side] for side in now)  # no image ever changed sides
        # A rescan rebuilds the client from its Growing, which carries the test share (feast_edge.agent.growth).
        again = own_client("cam", load_data(root, TASK), client.growing)
        assert client.growing.test == 0.2 and torch.equal(again.test_images, client.test_images)
        before = now
    assert 0 < len(before["test"]) < 150 and 0 < len(before["held"]) < 150


def test_the_held_out_split_does_not_move_when_a_test_split_is_added(tmp_path: Path) -> None:
    _write(tmp_path / "cam", 0, 120)
    (plain,) = load_clients(tmp_path / "cam", "cam", task=TASK, holdout=0.3)
    (tested,) = load_clients(tmp_path / "cam", "cam", task=TASK, holdout=0.3, test_split=0.25)
    assert torch.equal(plain.holdout_images, tested.holdout_images) and plain.test_samples == 0
    draws = content_draws(tested.test_images, tested.test_labels)
    assert ((draws >= 0.3) & (draws < 0.55)).all()
    rng = np.random.default_rng(3)
    images = torch.from_numpy(rng.integers(0, 256, (200, 1, 8, 8), np.uint8))
    labels = torch.from_numpy(rng.integers(0, 3, 200))
    train, held, _ = content_bands(images, labels, 0.1, 0.0)
    assert [t.tolist() for t in (train, held)] == [t.tolist() for t in content_split(images, labels, 0.1)]

    # A positional source (a shard, a partition, Fashion-MNIST): the held-out draw is the one without a test split.
    shard = LocalClient("s", images, labels, None, None, None, "shard")
    assert torch.equal(shard.with_holdout(0.1).holdout_images, shard.with_holdout(0.1, test=0.2).holdout_images)


def test_a_positional_test_split_is_a_seeded_per_class_draw_from_the_training_examples() -> None:
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    images = torch.arange(100, dtype=torch.uint8).reshape(100, 1, 1, 1).expand(100, 1, 2, 2).contiguous()
    client = LocalClient("s", images, labels, None, None, None, "shard")
    split = client.with_holdout(0.1, test=0.18)
    ids = {name: set(getattr(split, f).flatten().tolist()[::4]) for name, f in
           (("train", "images"), ("held", "holdout_images"), ("test", "test_images"))}  # fmt: skip
    assert not (ids["train"] & ids["test"] or ids["held"] & ids["test"]) and len(set().union(*ids.values())) == 100
    # 0.18 of all is 0.2 of what the held-out draw leaves, per class: 45 -> 9, 27 -> 5, 18 -> 4
    assert torch.bincount(split.test_labels, minlength=3).tolist() == [9, 5, 4]
    assert torch.equal(client.with_holdout(0.1, test=0.18).test_images, split.test_images)  # seeded
    assert client.with_holdout(0.0) is client  # no split at all: the client itself, as before


def test_shares_that_leave_too_little_to_train_on_are_refused_with_the_fix() -> None:
    client = LocalClient(
        "s", torch.zeros(10, 1, 2, 2, dtype=torch.uint8), torch.zeros(10).long(), None, None, None, "x"
    )
    with pytest.raises(DataError, match=r"--holdout 0.5 and --test-split 0.5 .* keep their sum at most 0.9"):
        client.with_holdout(0.5, test=0.5)
    with pytest.raises(DataError, match="--test-split"):
        client.with_holdout(0.1, test=-0.2)


def test_feast_agent_run_refuses_shares_that_leave_too_little_to_train_on_before_it_connects(
    tmp_path: Path, agent_cli
) -> None:
    for i, name in enumerate(("Trouser", "Bag") * 3):  # two of fmnist-small's classes, the preset run loads
        folder = tmp_path / "cam" / name
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (28, 28), np.uint8)).save(folder / f"{i}.png")
    result = agent_cli.invoke(
        "run", "--data", str(tmp_path / "cam"), "--budget", "1M", "--device-id", "cam", "--insecure",
        "--broker", "mqtt://127.0.0.1:1", "--holdout", "0.5", "--test-split", "0.5", "--log-level", "warning",
    )  # fmt: skip
    agent_cli.assert_user_error(result, "--holdout 0.5 and --test-split 0.5 leave 0% of the examples to train on")
