"""Decoding images into the task's uint8 tensors, in parallel threads (Pillow releases the GIL while it decodes).

Each item becomes ``Task.image_tensor`` of it (turned upright by its EXIF
orientation, converted, resized), written into its row of a preallocated
``[M, C, S, S]`` uint8 array (in RAM or a memory map of the cache file). An
item that cannot be decoded leaves its row unused and gets a skip reason
(:mod:`feast_edge.data.skips`), never an exception (a malformed EXIF block is
no reason: the image is read as stored):

* Pillow cannot identify it as PNG, JPEG, WebP or BMP    -> not an image file
* it is truncated or corrupt                              -> corrupt or truncated image
* it has more pixels than Pillow's ``Image.MAX_IMAGE_PIXELS`` (89.5 MP by default) -> too many pixels
* it cannot be opened (permission, I/O error)             -> unreadable
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from feast_edge.data import skips as why
from feast_edge.data.task import Task

FORMATS = ("PNG", "JPEG", "WEBP", "BMP")  # what Pillow may parse: nothing else, whatever a file's name says
Progress = Callable[[int, int], None]


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def open_file(path: str) -> Any:
    """A lazily decoded Pillow image of one of ``FORMATS``."""
    from PIL import Image

    return Image.open(path, formats=FORMATS)


def open_array(pixels: np.ndarray) -> Any:
    """A ``[C, H, W]`` uint8 array (C = 1 or 3) as a Pillow image."""
    from PIL import Image

    if pixels.shape[0] == 1:
        return Image.fromarray(np.ascontiguousarray(pixels[0]), "L")
    return Image.fromarray(np.ascontiguousarray(pixels.transpose(1, 2, 0)), "RGB")


def _reason(exc: BaseException) -> str:
    from PIL import Image, UnidentifiedImageError

    if isinstance(exc, Image.DecompressionBombError):
        return why.TOO_MANY_PIXELS
    if isinstance(exc, UnidentifiedImageError):
        return why.NOT_IMAGE
    if isinstance(exc, OSError) and exc.errno is not None:  # the file system's errors; Pillow's carry no errno
        return why.UNREADABLE
    return why.CORRUPT


def decode_one(item: Any, opener: Callable[[Any], Any], task: Task, row: np.ndarray) -> str | None:
    """Decode ``item`` into ``row`` (``[C, S, S]`` uint8); None, or the reason it was skipped."""
    from PIL import Image

    try:
        with opener(item) as image:
            limit = Image.MAX_IMAGE_PIXELS
            if limit is not None and image.size[0] * image.size[1] > limit:
                return why.TOO_MANY_PIXELS
            row[...] = task.image_tensor(image).numpy()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure of one file is that file's skip reason, never a crash
        return _reason(exc)


def decode_into(
    out: np.ndarray,
    items: Sequence[Any],
    opener: Callable[[Any], Any],
    task: Task,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> list[str | None]:
    """Decode every item into its row of ``out``; per item None (decoded) or its skip reason.

    ``workers`` threads (default: the CPUs this process may use) take chunks of
    items; ``progress(done, total)`` is called from this thread as chunks finish.
    """
    from PIL import Image

    total = len(items)
    if out.shape[0] < total or tuple(out.shape[1:]) != task.shape:
        raise ValueError(f"decode_into: out {tuple(out.shape)} cannot hold {total} images of {task.shape}")
    reasons: list[str | None] = [None] * total
    workers = default_workers() if workers is None else max(1, int(workers))
    chunk = max(1, min(256, total // (workers * 8) or 1))
    starts = range(0, total, chunk)

    def work(start: int) -> int:
        stop = min(total, start + chunk)
        for i in range(start, stop):
            reasons[i] = decode_one(items[i], opener, task, out[i])
        return stop - start

    done = 0
    with warnings.catch_warnings():
        # Images between Pillow's pixel limit and twice it only warn when opened; decode_one counts them as skipped.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        if workers == 1 or total <= chunk:
            for start in starts:
                done += work(start)
                if progress is not None:
                    progress(done, total)
            return reasons
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="decode")
        try:
            for future in [pool.submit(work, start) for start in starts]:
                done += future.result()
                if progress is not None:
                    progress(done, total)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: the chunks not started are dropped
    return reasons
