"""Bad input to load_data: each a counted skip or a one-line error, never a crash, nothing else lost (files written here)."""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from feast_edge.data import skips as why
from feast_edge.data.images import DataError
from feast_edge.data.sources import load_data
from feast_edge.data.task import Task, TaskError

TASK = Task(1, 8, ("ant", "bee", "cat"), (0.5,), (0.25,))


@pytest.fixture(autouse=True)
def _no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEAST_EDGE_DATA_CACHE", "off")  # every load decodes: what is skipped is decided now


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels: a decompression bomb's shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


GOOD = _png(np.full((8, 8), 77, np.uint8))
NOISE = np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)


def test_broken_and_foreign_files_are_counted_and_the_rest_loads(tmp_path: Path) -> None:
    png, jpeg = _png(NOISE), _jpeg(NOISE)
    idat = png.index(b"IDAT")
    corrupt = png[: idat + 40] + bytes(b ^ 0x5A for b in png[idat + 40 : idat + 400]) + png[idat + 400 :]
    root = _write(
        tmp_path / "d",
        {
            "ant/good.png": GOOD,
            "ant/cut.png": png[: len(png) // 2],  # truncated PNG
            "ant/cut.jpg": jpeg[: len(jpeg) // 2],  # truncated JPEG
            "bee/good.jpg": _jpeg(NOISE),
            "bee/scrambled.png": corrupt,  # a PNG whose data no longer matches its CRC
            "bee/empty.webp": b"",
            "bee/text.png": b"hello, I am not a PNG",  # an image's name, not an image's content
            "bee/notes.txt": b"a note",  # not an image's name
            "cat/gif.bmp": _gif(),  # a format the loader does not parse, whatever the name says
            "cat/good.bmp": _bmp(),
            "README.md": b"# about these images",  # outside any class folder
        },
    )
    data = load_data(root, TASK)
    assert len(data) == 3 and data.labels.tolist() == [0, 1, 2]
    assert data.skipped == {why.CORRUPT: 3, why.NOT_IMAGE: 4, why.OUTSIDE_CLASS: 1}
    assert data.source.endswith("3 images in 3 classes, 8 left out")


def _gif() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(out, format="GIF")
    return out.getvalue()


def _bmp() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((5, 9, 3), np.uint8)).save(out, format="BMP")
    return out.getvalue()


def test_the_console_line_counts_and_names_what_was_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = {"ant/a.png": GOOD, "ant/b.png": b"x", "ant/c.png": b"y", "ant/z.txt": b"z", "bee/d.png": b"d"}
    root = _write(tmp_path / "d", files)
    with caplog.at_level(logging.WARNING, logger="feast_edge.data"):
        load_data(root, TASK)
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("feast_edge.data")]  # not a neighbour's
    # What the listing left out first (by name), then what decoding did; three names, then "...".
    expected = "left out 4 not an image file (ant/z.txt, ant/b.png, ant/c.png, ...)"
    assert line == f"image folder {root.resolve()}: {expected}"


def test_decompression_bombs_are_skipped_by_pillows_pixel_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = Image.MAX_IMAGE_PIXELS
    assert limit == 89_478_485  # Pillow's default
    root = _write(
        tmp_path / "d",
        {
            "ant/ok.png": GOOD,
            "ant/warns.png": _png_claiming(10_000, 10_000),  # over the limit: Pillow only warns on open
            "bee/raises.png": _png_claiming(20_000, 20_000),  # over twice the limit: Pillow refuses to open
        },
    )
    data = load_data(root, TASK)
    assert len(data) == 1 and data.skipped == {why.TOO_MANY_PIXELS: 2}
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 63)  # the limit is Pillow's, wherever it is set
    (root / "ant" / "warns.png").unlink()
    (root / "bee" / "raises.png").unlink()
    with pytest.raises(DataError, match=r"none of its 1 image files could be decoded \(1 too many pixels"):
        load_data(root, TASK)


def test_16_bit_palette_and_transparent_images_are_converted_not_skipped(tmp_path: Path) -> None:
    sixteen = Image.fromarray(np.full((8, 8), 0x8000, np.uint16))
    assert sixteen.mode == "I;16"
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    transparent = Image.new("P", (8, 8), 0)
    transparent.putpalette([255, 255, 255] * 256)
    files = {"ant/16bit.png": _save_image(sixteen), "bee/palette.png": _save_image(palette)}
    files["cat/clear.png"] = _save_image(transparent, transparency=0)  # fully transparent white: black
    files["cat/rgba.png"] = _png(np.dstack([np.full((8, 8, 3), 255, np.uint8), np.full((8, 8), 255, np.uint8)]))
    data = load_data(_write(tmp_path / "d", files), TASK)
    assert data.skipped == {} and [int(image.max()) for image in data.images] == [128, 255, 0, 255]


def _save_image(image: Image.Image, **save: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", **save)
    return out.getvalue()


def test_an_empty_class_folder_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = _write(tmp_path / "d", {"ant/a.png": GOOD, "bee/notes.txt": b"x"})
    (root / "cat").mkdir()
    with caplog.at_level(logging.WARNING, logger="feast_edge.data"):
        data = load_data(root, TASK)
    assert len(data) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert f"image folder {root.resolve()}: class folder bee/ holds no images" in messages
    assert f"image folder {root.resolve()}: class folder cat/ holds no images" in messages


def test_what_stops_the_load_says_what_and_how_to_fix_it(tmp_path: Path) -> None:
    with pytest.raises(
        TaskError, match=r"folder Bee/: class 'Bee' is not one of the task's 3 classes; did you mean 'bee'"
    ):
        load_data(_write(tmp_path / "a", {"Bee/x.png": GOOD}), TASK)
    (tmp_path / "b" / "ant").mkdir(parents=True)
    with pytest.raises(DataError, match=r"holds no image files in its class folders; lay out images as"):
        load_data(tmp_path / "b", TASK)
    (tmp_path / "c").mkdir()
    with pytest.raises(DataError, match=r"holds no class folders; lay out images as .*/<class name>/<file>"):
        load_data(tmp_path / "c", TASK)
    with pytest.raises(DataError, match=r"none of its 2 image files could be decoded \(2 not an image file"):
        load_data(_write(tmp_path / "e", {"ant/x.png": b"x", "bee/y.jpg": b"y"}), TASK)


def test_symlink_loops_and_folders_reached_twice_are_counted(tmp_path: Path) -> None:
    root = _write(tmp_path / "d", {"ant/a.png": GOOD, "ant/deep/b.png": GOOD, "cat/c.png": GOOD})
    outside = _write(tmp_path / "elsewhere", {"x.png": GOOD})
    os.symlink("..", root / "ant" / "deep" / "up")  # ant/deep/up -> ant: a loop
    os.symlink(root, root / "ant" / "root")  # to the root: a loop
    os.symlink("../cat", root / "ant" / "cats")  # into another class: its images stay that class's
    os.symlink("../ant/deep", root / "cat" / "same")  # a folder already read
    os.symlink("nowhere.png", root / "cat" / "gone.png")
    os.symlink("self.png", root / "cat" / "self.png")  # a file link to itself: a loop, not "permission denied"
    (root / "bee").symlink_to(outside)  # a class folder may be a link
    data = load_data(root, TASK)
    assert data.labels.tolist() == [0, 0, 1, 2]
    assert data.skipped == {why.SYMLINK_LOOP: 3, why.LINKED_TWICE: 2, why.BROKEN_LINK: 1}


def test_a_class_folder_name_with_a_newline_is_printed_escaped_in_the_one_line_error(tmp_path: Path) -> None:
    root = _write(tmp_path / "n", {"ant/a.png": GOOD, "be\ne/b.png": GOOD, "w\x1b[31masp/c.png": GOOD})
    with pytest.raises(TaskError) as caught:
        load_data(root, TASK)
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message  # one line, no terminal sequence
    assert "folder be\\ne/" in message and "w\\x1b[31masp/" in message


def test_manifest_rows_that_cannot_be_read_stop_with_their_line(tmp_path: Path) -> None:
    _write(tmp_path, {"img/a.png": GOOD, "img/b.txt": b"x"})
    cases = {
        "path,label\nimg/a.png,ant\nimg/missing.png,bee\n": r"line 3: img/missing.png does not exist \(relative paths",
        "img/a.png,ant\n\nimg/a.png,wasp\n": r"line 3: class 'wasp' is not one of the task's 3 classes",
        "img/a.png,ant,extra\n": r"line 1: 3 columns; each row is 'path,label'",
        "img,ant\n": r"line 1: img is a folder",
        ",ant\n": r"line 1: the path is empty",
        "path,label\n": r"lists no image files",
    }
    for text, needle in cases.items():
        (tmp_path / "m.csv").write_text(text)
        with pytest.raises((DataError, TaskError), match=needle):
            load_data(tmp_path / "m.csv", TASK)
    (tmp_path / "m.csv").write_text("img/a.png,ant\nimg/b.txt,bee\n")
    assert load_data(tmp_path / "m.csv", TASK).skipped == {why.NOT_IMAGE: 1}
    (tmp_path / "m.csv").write_bytes(b"img/a.png,\xff\xfe\n")
    with pytest.raises(DataError, match="is not UTF-8 text"):
        load_data(tmp_path / "m.csv", TASK)


_AS_UNPRIVILEGED = """
import json, sys
from feast_edge.data.sources import load_data
from feast_edge.data.task import Task
task = Task(1, 8, ("ant", "bee", "cat"), (0.5,), (0.25,))
probe, *paths = sys.argv[1:]
try:
    open(probe, "rb").close()
    out = {"probe": "readable"}
except PermissionError:
    out = {"probe": "denied"}
for path in paths:
    try:
        data = load_data(path, task, cache_dir=False)
        out[path] = {"images": len(data), "skipped": data.skipped}
    except Exception as exc:
        out[path] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


def test_unreadable_files_are_skipped_and_an_unreadable_root_stops(tmp_path: Path, repo: Path) -> None:
    """As root, chmod 000 stops no read: the loader runs in a process without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH."""
    files = _write(tmp_path / "files", {"ant/a.png": GOOD, "ant/locked.png": GOOD, "bee/b.png": GOOD})
    _write(files, {"bee/shut/c.png": GOOD})
    whole = _write(tmp_path / "whole", {"ant/a.png": GOOD})
    klass = _write(tmp_path / "class", {"ant/a.png": GOOD, "bee/b.png": GOOD})
    manifest = tmp_path / "m.csv"
    manifest.write_text("files/ant/a.png,ant\n")
    shut = [files / "ant" / "locked.png", files / "bee" / "shut", whole, klass / "bee", manifest]
    for path in shut:
        path.chmod(0)
    try:
        drop = []
        if os.geteuid() == 0:
            drop = [
                "setpriv",
                "--bounding-set=-dac_override,-dac_read_search",
                "--inh-caps=-dac_override,-dac_read_search",
            ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
        paths = [str(p) for p in (files, whole, klass, manifest)]
        run = subprocess.run(
            [*drop, sys.executable, "-c", _AS_UNPRIVILEGED, str(shut[0]), *paths],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        for path in shut:
            path.chmod(0o755)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["probe"] == "denied"  # the permissions really hold in that process
    assert out[paths[0]] == {"images": 2, "skipped": {why.UNREADABLE: 1, why.UNREADABLE_FOLDER: 1}}
    assert out[paths[1]]["error"].startswith(f"DataError: cannot read {whole}: permission denied; fix its permissions")
    assert out[paths[2]]["error"].startswith(f"DataError: cannot read class folder {klass / 'bee'} (Permission denied)")
    assert out[paths[3]]["error"].startswith(f"DataError: cannot read manifest {manifest}: permission denied")
