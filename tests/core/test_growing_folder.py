"""Folders that grow: the decoded cache decodes only new and changed files, and an image never changes sides of the
held-out split as its folder grows (feast_edge.data.decoded_cache, feast_edge.data.holdout.content_split)."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.agent.local_data import load_clients
from feast_edge.data import decode
from feast_edge.data.holdout import content_draws, content_split
from feast_edge.data.sources import load_data, scan_source
from feast_edge.data.task import Task, TaskError

TASK = Task(1, 8, ("ant", "bee", "cat"), (0.5,), (0.25,))


def _write(root: Path, start: int, count: int) -> None:
    """``count`` distinct tiny images, numbered from ``start``, spread over the task's classes."""
    for i in range(start, start + count):
        pixels = np.random.default_rng(i).integers(0, 256, (8, 8), np.uint8)
        path = root / TASK.classes[i % 3] / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path)


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many images each load decoded."""
    counts: list[int] = []
    real = decode.decode_into

    def counting(out, items, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts.append(len(items))
        return real(out, items, *args, **kwargs)

    monkeypatch.setattr("feast_edge.data.loaded.decode_into", counting)
    return counts


def _same_as_decoding_everything(data, root: Path) -> None:  # type: ignore[no-untyped-def]
    whole = load_data(root, TASK, cache_dir=False)
    assert torch.equal(data.images, whole.images) and torch.equal(data.labels, whole.labels)


@pytest.mark.parametrize("mapped", [False, True], ids=["in RAM", "memory-mapped"])
def test_a_growing_folder_decodes_only_its_new_files(
    tmp_path: Path, decodes: list[int], monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    if mapped:  # every set above the limit: decoded into, and read back from, a memory map of the cache file
        monkeypatch.setenv("FEAST_EDGE_DATA_MEMORY_LIMIT", "100")
    root, cache = tmp_path / "cam", tmp_path / "cache"
    _write(root, 0, 30)
    first = load_data(root, TASK, cache_dir=cache)
    assert decodes == [30] and first.reused == 0
    for step, (start, count) in enumerate([(30, 5), (35, 1), (36, 12)]):
        _write(root, start, count)
        grown = load_data(root, TASK, cache_dir=cache)
        assert decodes[-1] == count and grown.reused == start and len(grown) == start + count, step
        assert not grown.from_cache and len(list(cache.glob("*.safetensors"))) == 1
        _same_as_decoding_everything(grown, root)
    (root / "bee" / "0001.png").unlink()  # removed files drop out; nothing is decoded
    (root / "cat" / "0002.png").unlink()
    shrunk = load_data(root, TASK, cache_dir=cache)
    assert decodes[-1] == 0 and len(shrunk) == 46 and shrunk.reused == 46
    _same_as_decoding_everything(shrunk, root)
    before = len(decodes)
    assert load_data(root, TASK, cache_dir=cache).from_cache and len(decodes) == before  # a hit decodes nothing


def test_a_damaged_previous_entry_is_not_reused(
    tmp_path: Path, decodes: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    root, cache = tmp_path / "cam", tmp_path / "cache"
    _write(root, 0, 12)
    load_data(root, TASK, cache_dir=cache)
    (entry,) = cache.glob("*.safetensors")
    raw = bytearray(entry.read_bytes())
    raw[-3] ^= 0x01  # inside the rows index, which the hash covers
    entry.write_bytes(bytes(raw))
    _write(root, 12, 2)
    with caplog.at_level(logging.WARNING):
        grown = load_data(root, TASK, cache_dir=cache)
    assert decodes == [12, 14] and grown.reused == 0  # decoded whole: nothing of a damaged entry is trusted
    assert "is damaged" in caplog.text
    _same_as_decoding_everything(grown, root)


def test_held_out_images_stay_held_out_and_trained_ones_stay_trained_as_the_folder_grows(tmp_path: Path) -> None:
    root = tmp_path / "cam"
    held_before: set[bytes] = set()
    trained_before: set[bytes] = set()
    for start, count in [(0, 20), (20, 7), (27, 40), (67, 1), (68, 60)]:
        _write(root, start, count)
        (client,) = load_clients(root, "cam", task=TASK, holdout=0.3)
        held = {bytes(x.numpy().tobytes()) for x in client.holdout_images}
        trained = {bytes(x.numpy().tobytes()) for x in client.images}
        assert len(held) + len(trained) == start + count and not held & trained
        assert held_before <= held and trained_before <= trained  # no image ever changed sides
        held_before, trained_before = held, trained
    assert 0 < len(held_before) < 128


def test_the_split_is_a_function_of_each_image_and_its_class_alone() -> None:
    rng = np.random.default_rng(7)
    images = torch.from_numpy(rng.integers(0, 256, (300, 1, 8, 8), np.uint8))
    labels = torch.from_numpy(rng.integers(0, 3, 300))
    _, held = content_split(images, labels, 0.2)
    order = torch.from_numpy(rng.permutation(300))
    _, held_shuffled = content_split(images[order], labels[order], 0.2)
    assert sorted(order[held_shuffled].tolist()) == held.tolist()  # the same images, wherever they sit
    _, held_alone = content_split(images[:10], labels[:10], 0.2)
    assert held_alone.tolist() == [i for i in held.tolist() if i < 10]  # whatever else the folder holds
    other_class = content_draws(images[:50], (labels[:50] + 1) % 3)  # the class salts the draw
    assert not np.array_equal(other_class, content_draws(images[:50], labels[:50]))
    twins = content_draws(torch.cat([images[:1], images[:1]]), torch.tensor([2, 2]))
    assert twins[0] == twins[1]  # a duplicate of a held-out image is held out too: no copy of it trains


def test_the_held_out_share_of_a_class_is_binomial_around_the_fraction() -> None:
    n, fraction = 2000, 0.1
    images = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (3 * n, 1, 8, 8), np.uint8))
    labels = torch.arange(3).repeat_interleave(n)
    _, held = content_split(images, labels, fraction)
    sigma = math.sqrt(n * fraction * (1 - fraction))  # 13.4 of 2,000 at 0.1
    per_class = torch.bincount(labels[held], minlength=3).tolist()
    assert all(abs(k - n * fraction) < 4 * sigma for k in per_class), per_class
    draws = content_draws(images, labels)
    assert 0.0 <= draws.min() and draws.max() < 1.0
    # A class of one image holds it out exactly when its draw is below the fraction (then it trains on none of it).
    one = content_split(images[:1], labels[:1], fraction)[1].numel()
    assert one == int(draws[0] < fraction)
    assert content_split(images, labels, 0.0)[1].numel() == 0


def test_a_class_folder_the_task_lacks_stops_a_scan_or_is_skipped_by_a_rescan(tmp_path: Path) -> None:
    root = tmp_path / "cam"
    _write(root, 0, 6)
    shutil.copytree(root / "ant", root / "wasp")
    with pytest.raises(TaskError, match="wasp"):
        scan_source(root, TASK)  # as load_data does at start
    listing = scan_source(root, TASK, unknown="skip")
    assert listing.files.unknown == ["wasp"] and len(listing.files.paths) == 6
    manifest = tmp_path / "cam.csv"
    manifest.write_text("cam/ant/0000.png,ant\ncam/wasp/0000.png,wasp\n")
    with pytest.raises(TaskError, match="wasp"):
        scan_source(manifest, TASK)
    rows = scan_source(manifest, TASK, unknown="skip")
    assert rows.files.unknown == ["wasp"] and rows.files.names == ["cam/ant/0000.png"]
