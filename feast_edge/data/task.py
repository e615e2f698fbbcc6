"""The task contract: what a federation trains on, defined once in the preset and announced to every device.

A task is the input a model takes and the classes it tells apart, *by name*:

    channels   1 (grey, ITU-R 601-2 luma) or 3 (RGB); every image is converted to it
    size       the square side the model takes; every image is brought to it by ``resize``
    resize     "stretch"      resize to size x size, ignoring the aspect ratio (what torchvision's Resize((s, s)) does)
               "center-crop"  resize the shorter side to size, then crop the centre (keeps the aspect ratio)
               "pad"          resize the longer side to size, then pad the rest with black (keeps the whole image)
    classes    the class names, in the order of the model's outputs
    mean, std  per-channel normalization of pixels in [0, 1]

Before any of it, an image is turned upright by its EXIF Orientation tag (how
a phone records a photo taken sideways, and how viewers show it): every image
is read as people see it, in training, the decoded cache, ``predict`` and
``evaluate`` alike. An image without the tag, or with a malformed EXIF block
or value, is read as stored (never skipped).

It has a digest (SHA-256 of its canonical JSON): the server announces the task
when a device registers, the agent checks its own data against it before
anything trains, and every device maps its labels to the task's indices by
class name, so a device holding 3 of the 10 classes trains with the task's
indices for those 3. The digest is separate from the preset's (which covers the
tensor shapes and costs only), so naming classes changes no cache or checkpoint.

Class names double as the folder names of an image folder (``<root>/<class>/``),
so they must be valid folder names: no ``/`` or ``\\``, no control characters,
not ``.`` or ``..``, at most 100 characters.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from feast_edge.errors import FeastError

if TYPE_CHECKING:  # numpy, torch and Pillow load only where images are converted: presets stay light to import
    import torch

RESIZE_POLICIES = ("stretch", "center-crop", "pad")
MAX_CLASSES = 10_000
MAX_NAME = 100
MAX_SIZE = 4096
CHANNELS = {1: "L", 3: "RGB"}  # input channels -> the Pillow mode every image is converted to


class TaskError(FeastError, ValueError):
    """A task is malformed, or data does not fit it."""


def check_class_name(name: Any, where: str = "task") -> str:
    """``name`` if it can name a class (and its folder); TaskError saying what is wrong otherwise."""
    if not isinstance(name, str) or not name or name.strip() != name:
        raise TaskError(f"{where}: class name {name!r} must be a non-empty string without surrounding spaces")
    if len(name) > MAX_NAME:
        raise TaskError(f"{where}: class name {name[:24]!r}... is longer than {MAX_NAME} characters")
    if name in (".", "..") or any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise TaskError(
            f"{where}: class name {name!r} cannot name a folder (no '/', '\\', control characters, '.' or '..'); "
            "rename the class"
        )
    return name


@dataclass(frozen=True)
class Task:
    """One federation's task (see the module docstring)."""

    channels: int
    size: int
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: str = "stretch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))
        if self.channels not in CHANNELS:
            raise TaskError(f"task: {self.channels} input channels; a task takes 1 (grey) or 3 (RGB)")
        if not 1 <= self.size <= MAX_SIZE:
            raise TaskError(f"task: input size {self.size} must be between 1 and {MAX_SIZE}")
        if self.resize not in RESIZE_POLICIES:
            raise TaskError(f"task: resize {self.resize!r} is unknown; choose one of {', '.join(RESIZE_POLICIES)}")
        if not 1 <= len(self.classes) <= MAX_CLASSES:
            raise TaskError(f"task: {len(self.classes)} classes; a task has 1 to {MAX_CLASSES}")
        for name in self.classes:
            check_class_name(name)
        if len(set(self.classes)) != len(self.classes):
            twice = sorted({c for c in self.classes if self.classes.count(c) > 1})
            raise TaskError(
                f"task: class name(s) {', '.join(map(repr, twice))} appear twice; class names must be unique"
            )
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise TaskError(f"task: mean and std need one value per channel ({self.channels})")
        if not all(math.isfinite(m) for m in self.mean) or not all(s > 0 and math.isfinite(s) for s in self.std):
            raise TaskError("task: mean must be finite and std finite and > 0")

    # ------------------------------------------------------------------ identity
    def to_dict(self) -> dict[str, Any]:
        return {
            "channels": self.channels,
            "size": self.size,
            "resize": self.resize,
            "classes": list(self.classes),
            "mean": list(self.mean),
            "std": list(self.std),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Task:
        """A task from its JSON form (e.g. as the server announces it), every field validated and bounded."""
        if not isinstance(data, Mapping):
            raise TaskError("task: must be a JSON object")
        unknown = sorted(set(data) - {"channels", "size", "resize", "classes", "mean", "std"})
        if unknown:
            raise TaskError(f"task: unknown field(s) {', '.join(unknown[:5])}")
        try:
            classes, mean, std = data["classes"], data["mean"], data["std"]
            if not isinstance(classes, list) or len(classes) > MAX_CLASSES:
                raise TaskError(f"task: 'classes' must be a list of at most {MAX_CLASSES} names")
            if not isinstance(mean, list) or not isinstance(std, list) or len(mean) > 3 or len(std) > 3:
                raise TaskError("task: 'mean' and 'std' must be lists of one value per channel")
            numbers = [*mean, *std]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
                raise TaskError("task: 'mean' and 'std' must hold numbers")
            channels, size = data["channels"], data["size"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (channels, size)):
                raise TaskError("task: 'channels' and 'size' must be integers")
            return cls(
                channels=channels,
                size=size,
                classes=tuple(classes),
                mean=tuple(mean),
                std=tuple(std),
                resize=str(data.get("resize", "stretch")),
            )
        except KeyError as exc:
            raise TaskError(f"task: lacks the field {exc.args[0]!r}") from None

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON form: two tasks with one digest turn the same files into the same tensors."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.channels, self.size, self.size)

    def describe(self) -> str:
        shown = ", ".join(self.classes[:6]) + (f", ... ({len(self.classes)} in all)" if len(self.classes) > 6 else "")
        return f"{self.channels}x{self.size}x{self.size} ({self.resize}), classes {shown}"

    # ------------------------------------------------------------------ labels by name
    def index_of(self, name: str, where: str = "") -> int:
        """The task's index of class ``name``; TaskError naming the closest task classes otherwise."""
        try:
            return self.classes.index(name)
        except ValueError:
            pass
        near = difflib.get_close_matches(name, self.classes, n=3, cutoff=0.6)
        folded = [c for c in self.classes if c.casefold() == name.casefold()]
        hint = f"; did you mean {', '.join(map(repr, folded or near))}?" if folded or near else ""
        prefix = f"{where}: " if where else ""
        raise TaskError(
            f"{prefix}class {name!r} is not one of the task's {len(self.classes)} classes{hint} "
            f"(the task's classes: {', '.join(self.classes[:10])}{', ...' if len(self.classes) > 10 else ''}); "
            "rename the folder or label, or remove it"
        )

    def label_map(self, names: Iterable[str], where: str = "") -> torch.Tensor:
        """Source label ``i`` (the ``i``-th of ``names``) -> the task's index of that name, as an int64 lookup table."""
        import torch

        return torch.tensor([self.index_of(n, where) for n in names], dtype=torch.long)

    # ------------------------------------------------------------------ one image
    def image_tensor(self, image: Any) -> torch.Tensor:
        """A Pillow image as the task's uint8 ``[C, size, size]``: turned upright, converted to grey/RGB, resized by the policy."""
        import numpy as np
        import torch
        from PIL import Image

        image.load()  # a truncated or corrupt file fails here, before the EXIF block is read (which must never fail)
        turn = upright_transpose(image)  # read first: the converted image no longer carries the EXIF block
        image = _eight_bit(image)
        mode = CHANNELS[self.channels]
        if image.mode != mode:
            if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
                # Transparent pixels become black, as they show in most viewers' dark theme and in training sets.
                image = image.convert("RGBA")
                canvas = Image.new("RGBA", image.size, (0, 0, 0, 255))
                canvas.alpha_composite(image)
                image = canvas
            image = image.convert(mode)
        if turn is not None:
            image = image.transpose(turn)  # before the resize: crop and pad act on the upright picture
        image = self._resized(image)
        array = np.asarray(image, dtype=np.uint8)
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()

    def _resized(self, image: Any) -> Any:
        from PIL import Image

        s = self.size
        width, height = image.size
        if (width, height) == (s, s):
            return image
        if self.resize == "stretch":
            return image.resize((s, s), Image.Resampling.BILINEAR)
        if self.resize == "center-crop":
            scale = s / min(width, height)
            w, h = max(s, round(width * scale)), max(s, round(height * scale))
            image = image.resize((w, h), Image.Resampling.BILINEAR)
            left, top = (w - s) // 2, (h - s) // 2
            return image.crop((left, top, left + s, top + s))
        scale = s / max(width, height)
        w, h = max(1, round(width * scale)), max(1, round(height * scale))
        image = image.resize((w, h), Image.Resampling.BILINEAR)
        canvas = Image.new(image.mode, (s, s), 0)
        canvas.paste(image, ((s - w) // 2, (s - h) // 2))
        return canvas

    def normalized(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, C, H, W]`` -> float32 ``(pixels / 255 - mean) / std``, what the model takes."""
        shape = (1, -1, 1, 1)
        pixels = images.float().div_(255.0)
        return (pixels - pixels.new_tensor(self.mean).view(shape)) / pixels.new_tensor(self.std).view(shape)


EXIF_ORIENTATION = 0x0112
# EXIF Orientation -> the transpose that shows the picture upright; Pillow's ImageOps.exif_transpose table.
# 1 is upright already; any other value (0, 9, ...) is not an orientation, and the image is read as stored.
_UPRIGHT = {
    2: "FLIP_LEFT_RIGHT",
    3: "ROTATE_180",
    4: "FLIP_TOP_BOTTOM",
    5: "TRANSPOSE",
    6: "ROTATE_270",
    7: "TRANSVERSE",
    8: "ROTATE_90",
}


def upright_transpose(image: Any) -> Any:
    """The ``Image.Transpose`` that turns ``image`` upright by its EXIF orientation; None if it needs none.

    Not ``ImageOps.exif_transpose``: that copies every image without a tag and
    rewrites the EXIF block of every image with one, which can raise on a
    malformed block. Here a malformed block (or value) reads as "no
    orientation": the picture is still fine, only its metadata is not.
    """
    from PIL import Image

    try:
        orientation = image.getexif().get(EXIF_ORIENTATION)
    except Exception:  # noqa: BLE001 - Pillow's EXIF parser raises many types (SyntaxError, struct.error, ...)
        return None
    name = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    return None if name is None else Image.Transpose[name]


def _eight_bit(image: Any) -> Any:
    """Images of more than 8 bits per channel (16-bit PNG/TIFF, 32-bit integer or float) scaled to 8-bit grey."""
    import numpy as np
    from PIL import Image

    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        array = np.asarray(image, dtype=np.uint16)
        return Image.fromarray((array >> 8).astype(np.uint8), "L")
    if image.mode == "I":
        array = np.asarray(image, dtype=np.int64)
        top = 65535 if array.max(initial=0) > 255 else 255
        return Image.fromarray((np.clip(array, 0, top) * 255 // top).astype(np.uint8), "L")
    if image.mode == "F":
        array = np.nan_to_num(np.asarray(image, dtype=np.float32))
        top = 1.0 if array.max(initial=0.0) <= 1.0 else 255.0
        return Image.fromarray((np.clip(array / top, 0, 1) * 255).round().astype(np.uint8), "L")
    return image


def default_class_names(count: int) -> tuple[str, ...]:
    """Names of a preset that names no classes: ``"0"``, ``"1"``, ... (folders named by index)."""
    return tuple(str(i) for i in range(count))
