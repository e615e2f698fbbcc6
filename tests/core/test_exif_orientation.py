"""Images as people take them: a photo's EXIF orientation is applied wherever an image is read (issue 37, deliverable 4).

A phone stores a photo taken in portrait as the sensor saw it (sideways) with
an EXIF Orientation tag saying how to turn it; training, the decoded cache,
``predict`` and ``evaluate`` must all see the upright picture, and a malformed
tag must leave the image as stored, never skip it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from feast_edge.data import decoded_cache
from feast_edge.data.decoded_cache import CacheEntry
from feast_edge.data.folder_stats import pixel_stats
from feast_edge.data.sources import load_data
from feast_edge.data.task import Task
from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.evaluate.predict import OnnxModel, read_image, read_images
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset_file
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET

CLASSES = ("ant", "bee")
ORIENTATION = 0x0112
T = Image.Transpose
# Orientation -> how the camera stored the upright picture (the inverse of the turn a viewer applies).
STORED = {
    1: None,
    2: T.FLIP_LEFT_RIGHT,
    3: T.ROTATE_180,
    4: T.FLIP_TOP_BOTTOM,
    5: T.TRANSPOSE,
    6: T.ROTATE_90,
    7: T.TRANSVERSE,
    8: T.ROTATE_270,
}
JPEG_TOLERANCE = 16  # the largest pixel difference JPEG's quantization leaves on these flat 8x8 blocks


def _task(resize: str = "stretch") -> Task:
    return Task(3, 16, CLASSES, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), resize=resize)


def _upright() -> Image.Image:
    """A 24x16 picture of six flat 8x8 blocks of distinct colours: no flip or turn of it looks like another."""
    colours = [[(220, 30, 30), (30, 200, 40), (30, 40, 220)], [(240, 240, 240), (10, 10, 10), (230, 200, 20)]]
    pixels = np.kron(np.array(colours, dtype=np.uint8), np.ones((8, 8, 1), dtype=np.uint8))
    return Image.fromarray(pixels, "RGB")


def _save(path: Path, orientation: int | None, exif: bytes | None = None) -> Path:
    """The upright picture as a camera stores it with ``orientation`` (or a raw ``exif`` block, stored upright)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = _upright()
    block: Image.Exif | bytes = b"" if exif is None else exif
    if orientation is not None:
        turn = STORED.get(orientation)
        image = image if turn is None else image.transpose(turn)
        block = Image.Exif()
        block[ORIENTATION] = orientation
    options = {"quality": 95, "subsampling": 0} if path.suffix == ".jpg" else {}
    image.save(path, exif=block, **options)
    return path


def _as_stored(path: Path, task: Task) -> torch.Tensor:
    """The file's pixels as stored, orientation ignored (a Pillow image without EXIF)."""
    with Image.open(path) as image:
        return task.image_tensor(Image.fromarray(np.asarray(image.convert("RGB"))))


def _distance(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.int() - b.int()).abs().max())


def _assert_upright(got: torch.Tensor, task: Task, path: Path) -> None:
    """``got`` is the upright picture within JPEG tolerance, and far from the picture as stored (sideways)."""
    want = task.image_tensor(_upright())
    assert _distance(got, want) <= JPEG_TOLERANCE
    assert _distance(_as_stored(path, task), want) > 100  # the test tells sideways from upright


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_orientation_decodes_to_the_upright_picture(tmp_path: Path, orientation: int) -> None:
    path = _save(tmp_path / "photo.png", orientation)  # PNG: lossless, so upright means equal
    with Image.open(path) as image:
        assert np.array_equal(np.asarray(ImageOps.exif_transpose(image)), np.asarray(_upright()))  # Pillow agrees
    task = _task()
    with Image.open(path) as image:
        assert torch.equal(task.image_tensor(image), task.image_tensor(_upright()))


@pytest.mark.parametrize("resize", ["stretch", "center-crop", "pad"])
def test_a_phone_jpeg_is_turned_before_it_is_resized(tmp_path: Path, resize: str) -> None:
    path = _save(tmp_path / "phone.jpg", 6)
    task = _task(resize)
    with Image.open(path) as image:
        assert image.size == (16, 24)  # stored sideways
        _assert_upright(task.image_tensor(image), task, path)


def test_training_data_is_upright(tmp_path: Path) -> None:
    """An image folder ``DIR/<class>/`` as ``feast-agent run --data`` reads it (``load_data``)."""
    phone = _save(tmp_path / "data" / "ant" / "phone.jpg", 6)
    _save(tmp_path / "data" / "bee" / "scan.png", None)
    task = _task()
    data = load_data(tmp_path / "data", task, cache_dir=False)
    assert data.labels.tolist() == [0, 1] and data.skipped == {}
    _assert_upright(data.images[0], task, phone)
    assert torch.equal(data.images[1], task.image_tensor(_upright()))


def test_the_decoded_cache_holds_upright_images_and_replaces_an_entry_from_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    phone = _save(tmp_path / "data" / "ant" / "phone.jpg", 6)
    task, cache = _task(), tmp_path / "cache"
    with monkeypatch.context() as before:  # the cache a version 1 agent wrote: images as stored, sideways
        before.setattr(decoded_cache, "FORMAT_VERSION", 1)
        before.setattr("feast_edge.data.task.upright_transpose", lambda image: None)
        old = load_data(tmp_path / "data", task, cache_dir=cache)
        old_key = CacheEntry.of(cache, {"task": task.digest}, ["phone.jpg"])
    assert torch.equal(old.images[0], _as_stored(phone, task))
    [old_file] = cache.glob("*.safetensors")
    new_key = CacheEntry.of(cache, {"task": task.digest}, ["phone.jpg"])
    assert new_key.key != old_key.key and new_key.slot == old_key.slot  # another entry, in the same source's slot

    with caplog.at_level(logging.INFO, logger="feast_edge"):
        rebuilt = load_data(tmp_path / "data", task, cache_dir=cache)
    assert not rebuilt.from_cache  # the old entry is stale: decoded again, upright
    _assert_upright(rebuilt.images[0], task, phone)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # stale is not damaged
    assert not old_file.exists() and len(list(cache.glob("*.safetensors"))) == 1  # and it was replaced

    again = load_data(tmp_path / "data", task, cache_dir=cache)
    assert again.from_cache and torch.equal(again.images, rebuilt.images)


def test_predict_reads_files_upright(tmp_path: Path) -> None:
    phone = _save(tmp_path / "phone.jpg", 6)
    task = _task()
    _assert_upright(read_image(phone, task), task, phone)
    images, kept, skipped = read_images([phone], task)
    assert kept == [0] and not skipped and torch.equal(images[0], read_image(phone, task))


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test supernet's smallest variant, exported for a 3x16x16 task of CLASSES (untrained: inputs matter here)."""
    tiny = load_preset_file(TINY_PRESET)
    preset = dataclasses.replace(
        tiny, name="test-rgb", in_channels=3, mean=(0.5,) * 3, std=(0.25,) * 3, class_names=(*CLASSES, "c", "d", "e")
    )
    arch = Arch.smallest(preset)
    path = tmp_path_factory.mktemp("model") / "rgb.onnx"
    export_onnx(extract(Supernet(preset, seed=0), arch).eval(), path, preset, arch)
    return path


def test_feast_agent_predict_and_evaluate_give_the_model_upright_images(
    agent_cli, rgb_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.Tensor] = []
    real = OnnxModel.probabilities

    def spy(self: OnnxModel, images: torch.Tensor) -> np.ndarray:
        seen.append(images.clone())
        return real(self, images)

    monkeypatch.setattr(OnnxModel, "probabilities", spy)
    phone = _save(tmp_path / "data" / "ant" / "phone.jpg", 6)
    task = _task()
    predicted = agent_cli.invoke("predict", "--model", str(rgb_model), str(phone), "--json")
    assert predicted.returncode == 0, predicted.stderr
    [images] = seen
    _assert_upright(images[0], task, phone)

    seen.clear()
    cache = {"FEAST_EDGE_DATA_CACHE": str(tmp_path / "cache")}
    evaluated = agent_cli.invoke("evaluate", "--model", str(rgb_model), "--data", str(tmp_path / "data"), env=cache)
    assert evaluated.returncode == 0, evaluated.stderr
    [images] = seen
    _assert_upright(images[0], task, phone)


@pytest.mark.parametrize(
    ("name", "orientation", "exif"),
    [
        ("nine.jpg", 9, None),  # not one of the eight orientations
        ("zero.jpg", 0, None),
        ("garbage.png", None, b"Exif\x00\x00not a TIFF header"),  # Pillow's EXIF parser raises on it
        pytest.param(  # its first IFD lies past the block's end: Pillow warns, as it does on opening such a JPEG
            "garbage.webp",
            None,
            b"Exif\x00\x00II*\x00\xff\xff\xff\x7f",
            marks=pytest.mark.filterwarnings("ignore:Corrupt EXIF data"),
        ),
    ],
)
def test_a_malformed_orientation_reads_the_image_as_stored_and_never_skips_it(
    tmp_path: Path, name: str, orientation: int | None, exif: bytes | None
) -> None:
    path = _save(tmp_path / "data" / "ant" / name, orientation, exif)
    task = _task()
    want = _as_stored(path, task)
    with Image.open(path) as image:
        assert torch.equal(task.image_tensor(image), want)
    assert torch.equal(read_image(path, task), want)
    data = load_data(tmp_path / "data", task, cache_dir=False)
    assert data.skipped == {} and torch.equal(data.images[0], want)
    assert pixel_stats(tmp_path / "data", task)[2] == 1  # preset new's statistics read it too


def test_a_parser_error_in_the_exif_block_is_one_the_reader_absorbs(tmp_path: Path) -> None:
    """The garbage block above does make Pillow raise (so that case tests the guard, not a block Pillow ignores)."""
    path = _save(tmp_path / "garbage.png", None, b"Exif\x00\x00not a TIFF header")
    with Image.open(path) as image, pytest.raises(SyntaxError):
        image.getexif()
