"""The decoded cache: a hit decodes nothing, any change to the files misses, a damaged file is rebuilt, big sets are mapped."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from feast_edge.data import decode
from feast_edge.data.decoded_cache import DEFAULT_LIMIT, memory_limit
from feast_edge.data.images import DataError
from feast_edge.data.sources import load_data
from feast_edge.data.task import Task

TASK = Task(3, 12, ("ant", "bee", "cat"), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for i in range(12):
        path = root / TASK.classes[i % 3] / f"{i}.{('png', 'jpg')[i % 2]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (10 + i, 14, 3), np.uint8)).save(path)
    return root


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many images each load decoded (0 on a cache hit)."""
    counts: list[int] = []
    real = decode.decode_into

    def counting(out, items, *args, **kwargs):
        counts.append(len(items))
        return real(out, items, *args, **kwargs)

    monkeypatch.setattr("feast_edge.data.loaded.decode_into", counting)
    return counts


def _mapped_file(tensor: torch.Tensor) -> str:
    """The file whose memory map holds the tensor's data ("" if none), from /proc/self/maps."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else ""
    return ""


def _files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.safetensors"))


def test_a_second_load_is_a_hit_that_decodes_nothing(folder: Path, cache: Path, decodes: list[int]) -> None:
    first = load_data(folder, TASK, cache_dir=cache)
    second = load_data(folder, TASK, cache_dir=cache)
    assert (first.from_cache, second.from_cache) == (False, True) and decodes == [12]
    assert torch.equal(first.images, second.images) and torch.equal(first.labels, second.labels)
    assert second.source == first.source and second.images.dtype == torch.uint8
    (only,) = _files(cache)
    written = load_file(str(only))  # a plain safetensors file
    assert torch.equal(written["images"], first.images) and torch.equal(written["labels"], first.labels)
    other = Task(3, 12, TASK.classes, TASK.mean, TASK.std, resize="center-crop")  # another task: another entry
    assert not load_data(folder, other, cache_dir=cache).from_cache and len(_files(cache)) == 2


@pytest.mark.parametrize("change", ["add", "remove", "touch", "edit", "chmod", "rename"])
def test_any_change_to_the_files_misses_decodes_only_the_changed_files_and_replaces_the_entry(
    folder: Path, cache: Path, decodes: list[int], change: str
) -> None:
    load_data(folder, TASK, cache_dir=cache)
    target = folder / "bee" / "1.jpg"
    if change == "add":
        Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(folder / "cat" / "new.png")
    elif change == "remove":
        target.unlink()
    elif change == "touch":
        st = target.stat()
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    elif change == "edit":
        st = target.stat()
        Image.fromarray(np.zeros((11, 14, 3), np.uint8)).save(target, format="JPEG")
        assert target.stat().st_mtime_ns != st.st_mtime_ns
    elif change == "chmod":
        target.chmod(0o600)
    else:
        target.rename(folder / "bee" / "1b.jpg")
    again = load_data(folder, TASK, cache_dir=cache)
    expected = {"add": 13, "remove": 11}.get(change, 12)
    decoded = 0 if change == "remove" else 1  # the new or changed file only: the others come from the old entry
    assert not again.from_cache and decodes == [12, decoded] and len(again) == expected
    assert again.reused == expected - decoded
    whole = load_data(folder, TASK, cache_dir=False)  # what decoding every file gives: the same rows, in order
    assert torch.equal(again.images, whole.images) and torch.equal(again.labels, whole.labels)
    assert len(_files(cache)) == 1  # the stale entry is gone
    assert load_data(folder, TASK, cache_dir=cache).from_cache


@pytest.mark.parametrize("damage", ["truncate", "edit-pixel", "edit-label", "edit-header", "empty"])
def test_a_damaged_cache_file_is_detected_logged_and_rebuilt(
    folder: Path, cache: Path, decodes: list[int], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    first = load_data(folder, TASK, cache_dir=cache)
    (path,) = _files(cache)
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    if damage == "truncate":
        raw = raw[:-100]
    elif damage == "edit-pixel":
        raw[-1] ^= 0xFF
    elif damage == "edit-label":
        raw[header] ^= 0x01  # labels come first
    elif damage == "edit-header":
        raw[20:24] = b"XXXX"
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="feast_edge.data"):
        again = load_data(folder, TASK, cache_dir=cache)
    assert not again.from_cache and decodes == [12, 12]
    assert torch.equal(again.images, first.images) and torch.equal(again.labels, first.labels)
    assert any(f"decoded cache {path} is damaged" in r.getMessage() for r in caplog.records)
    assert load_data(folder, TASK, cache_dir=cache).from_cache  # rebuilt whole


def test_above_the_memory_limit_the_images_are_a_map_of_the_cache_file(
    folder: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_ram = load_data(folder, TASK, cache_dir=False)
    (folder / "ant" / "junk.png").write_bytes(b"not a png")  # a skipped row inside the mapped file
    monkeypatch.setenv("FEAST_EDGE_DATA_MEMORY_LIMIT", "1K")  # 12 images of 3x12x12 = 5,184 bytes
    decoded = load_data(folder, TASK, cache_dir=cache)  # decoded straight into the cache file
    mapped = load_data(folder, TASK, cache_dir=cache)
    assert mapped.from_cache and not decoded.from_cache and decoded.skipped == {"not an image file": 1}
    (path,) = _files(cache)
    for data in (decoded, mapped):
        assert _mapped_file(data.images) == str(path)
        assert torch.equal(data.images, in_ram.images) and torch.equal(data.labels, in_ram.labels)
    assert _mapped_file(in_ram.images) != str(path)
    assert torch.equal(load_file(str(path))["images"], in_ram.images)  # the mapped file is a valid safetensors file
    mapped.images[0, 0, 0, 0] += 1  # copy-on-write: the file is not changed
    assert load_data(folder, TASK, cache_dir=cache).from_cache
    assert not list(cache.glob(".*.tmp"))


def test_the_memory_limit_reads_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert memory_limit() == DEFAULT_LIMIT == 2 * 1024**3
    for text, value in (("512M", 512 * 1024**2), ("1.5GiB", 3 * 1024**3 // 2), ("1000", 1000), ("0", 0)):
        monkeypatch.setenv("FEAST_EDGE_DATA_MEMORY_LIMIT", text)
        assert memory_limit() == value
    monkeypatch.setenv("FEAST_EDGE_DATA_MEMORY_LIMIT", "lots")
    with pytest.raises(DataError, match="FEAST_EDGE_DATA_MEMORY_LIMIT='lots' is not a size"):
        memory_limit()


def test_an_unwritable_cache_folder_is_a_warning_and_the_data_loads(
    folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where the cache folder would go")
    with caplog.at_level(logging.WARNING, logger="feast_edge.data"):
        data = load_data(folder, TASK, cache_dir=blocked / "cache")
    assert len(data) == 12 and not data.from_cache
    assert any("cannot write the decoded cache in" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("FEAST_EDGE_DATA_MEMORY_LIMIT", "0")  # above the limit and no cache: held in RAM after all
    assert torch.equal(load_data(folder, TASK, cache_dir=blocked / "cache").images, data.images)


def test_the_cache_folder_comes_from_the_environment(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FEAST_EDGE_DATA_CACHE", str(tmp_path / "env-cache"))
    load_data(folder, TASK)
    assert len(_files(tmp_path / "env-cache")) == 1
    monkeypatch.setenv("FEAST_EDGE_DATA_CACHE", "off")
    assert not load_data(folder, TASK).from_cache
    monkeypatch.delenv("FEAST_EDGE_DATA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load_data(folder, TASK)
    assert len(_files(tmp_path / "xdg" / "feast-edge" / "data")) == 1
