"""A device's own images, as a lab's camera would leave them: Fashion-MNIST training images written as files
``root/<class name>/<n>.<ext>`` in one of a few formats and sizes (the task's resize policy brings them back)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from PIL import Image

# style -> (colour mode, size or None for 28x28, file extension)
STYLES = {
    "png-grey": ("L", None, "png"),
    "jpeg-rgb-56": ("RGB", (56, 56), "jpg"),
    "png-rgb-40": ("RGB", (40, 40), "png"),
    "png-64": ("RGB", (64, 64), "png"),
    "jpeg-80x60": ("RGB", (80, 60), "jpg"),  # another aspect ratio
}


def write_image_folder(
    root: Path, counts: Mapping[int, int], style: str, train, class_names: Sequence[str], offset: int = 0
) -> None:
    """``counts[c]`` training images of each class ``c`` (from the ``offset``-th of that class on) as ``root/<name>/``."""
    mode, size, ext = STYLES[style]
    for c, count in counts.items():
        folder = root / class_names[c]
        folder.mkdir(parents=True)
        for n, i in enumerate((train.labels == c).nonzero().flatten()[offset : offset + count].tolist()):
            image = Image.fromarray(train.images[i, 0].numpy(), "L").convert(mode)
            if size is not None:
                image = image.resize(size)
            image.save(folder / f"{n}.{ext}", **({"quality": 95} if ext == "jpg" else {}))
