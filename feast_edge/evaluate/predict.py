"""Use an exported model on the device: image files in, class names and probabilities out (issue 20, deliverable 5).

The ONNX file says everything needed (:func:`~feast_edge.evaluate.onnx_export.model_task`):
each file is opened with Pillow, turned into the task's uint8 ``[C, size,
size]`` (EXIF orientation, grey/RGB conversion and resize policy:
``Task.image_tensor``, as in training), scaled to [0, 1] and run in
onnxruntime in batches; the graph normalizes the pixels itself. Probabilities
are the softmax of the logits.

A file that cannot be decoded (truncated, not an image, a decompression bomb)
is skipped and counted when it was found by walking a folder, and is an error
when it was named on its own.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feast_edge.data.task import Task
from feast_edge.errors import FeastError
from feast_edge.evaluate.onnx_export import (
    INPUT_NAME,
    OUTPUT_NAME,
    OnnxModelError,
    model_task,
    onnx_session,
    read_metadata,
)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_BATCH = 64
Progress = Callable[[int, int], None]  # (files done, files in all)


class ImageReadError(FeastError):
    """An image file cannot be opened or decoded."""


@dataclass(frozen=True)
class Skipped:
    """A file left out, and why (one line)."""

    file: str
    reason: str


@dataclass(frozen=True)
class OnnxModel:
    """An exported model loaded in onnxruntime, with the task its metadata describes."""

    path: Path
    task: Task
    meta: dict[str, str]
    session: Any

    def probabilities(self, images: torch.Tensor) -> np.ndarray:
        """uint8 ``[N, C, size, size]`` -> softmax probabilities ``[N, classes]`` (float64)."""
        pixels = images.numpy().astype(np.float32) / np.float32(255.0)  # the graph takes [0, 1] and normalizes itself
        logits = self.session.run([self.meta.get("output_name", OUTPUT_NAME)], {self.input_name: pixels})[0]
        return softmax(np.asarray(logits, dtype=np.float64))

    @property
    def input_name(self) -> str:
        return self.meta.get("input_name", INPUT_NAME)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for large logits."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def load_model(path: str | os.PathLike[str], threads: int | None = None) -> OnnxModel:
    """An exported file ready to run; OnnxModelError (one line) if it is missing, not ONNX or not feast-edge's."""
    path = Path(path)
    meta = read_metadata(path)
    task = model_task(meta) if meta else model_task(path)  # the path form names the file in the error
    if meta.get("input_range", "[0, 1]") != "[0, 1]":
        raise OnnxModelError(f"model {path} takes pixels in {meta['input_range']}; feast-edge models take [0, 1]")
    try:
        session = onnx_session(path, threads=threads)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types for a graph it cannot load
        raise OnnxModelError(f"model {path} cannot be loaded in onnxruntime ({exc}); fetch it again") from None
    inputs, outputs = session.get_inputs(), session.get_outputs()
    shape = list(inputs[0].shape[1:]) if inputs else []
    if shape != list(task.shape) or not outputs or outputs[0].shape[-1] != len(task.classes):
        raise OnnxModelError(
            f"model {path}: its graph takes {shape} and gives {outputs[0].shape if outputs else 'nothing'}, but its "
            f"metadata describes {task.describe()}; fetch or export it again"
        )
    return OnnxModel(path, task, meta, session)


# ---------------------------------------------------------------------- files


def is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def image_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The image files under ``folder``, recursively, sorted; hidden files and folders left out.

    Symbolic links to folders are not followed (a link loop cannot hang the walk); links to files are read.
    """
    found = []
    for root, dirs, files in os.walk(folder, onerror=None, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / name for name in files if is_image_name(Path(name))]
    return sorted(found)


def read_image(path: str | os.PathLike[str], task: Task) -> torch.Tensor:
    """One image file as the task's uint8 ``[C, size, size]``; ImageReadError saying why it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # > Pillow's pixel limit: refused, not read
            with Image.open(path) as image:
                image.load()
                return task.image_tensor(image)
    except UnidentifiedImageError:
        reason = "not an image Pillow can identify"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        reason = f"more than Pillow's limit of {Image.MAX_IMAGE_PIXELS:,} pixels (a decompression bomb?)"
    except PermissionError:
        reason = "permission denied"
    except FileNotFoundError:
        reason = "no such file"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated or corrupt data, per Pillow plugin
        reason = f"cannot be decoded: {exc or type(exc).__name__}"
    raise ImageReadError(f"{path}: {reason}")


def read_images(
    files: Sequence[Path], task: Task, progress: Progress | None = None
) -> tuple[torch.Tensor, list[int], list[Skipped]]:
    """Decode ``files``: the uint8 batch of those that could be read, their positions in ``files``, and the skipped."""
    tensors, kept, skipped = [], [], []
    for i, path in enumerate(files):
        try:
            tensors.append(read_image(path, task))
            kept.append(i)
        except ImageReadError as exc:
            skipped.append(Skipped(str(path), str(exc).removeprefix(f"{path}: ")))
        if progress is not None:
            progress(i + 1, len(files))
    images = torch.stack(tensors) if tensors else torch.empty((0, *task.shape), dtype=torch.uint8)
    return images, kept, skipped


# ---------------------------------------------------------------------- predict


@dataclass(frozen=True)
class Prediction:
    """The top classes of one file: (class name, task index, probability), most probable first."""

    file: str
    top: tuple[tuple[str, int, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "predictions": [{"class": name, "index": index, "probability": p} for name, index, p in self.top],
        }


@dataclass(frozen=True)
class Predictions:
    """What :func:`predict` returns: one prediction per readable file, in the files' order, and the skipped files."""

    items: tuple[Prediction, ...]
    skipped: tuple[Skipped, ...]

    def to_json(self) -> str:
        return json.dumps([p.to_dict() for p in self.items], indent=2)


def top_k(probabilities: np.ndarray, k: int, classes: Sequence[str]) -> list[tuple[tuple[str, int, float], ...]]:
    """Per row, the ``k`` most probable classes, highest first (ties: the lower index first)."""
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [tuple((classes[j], int(j), float(row[j])) for j in idx) for row, idx in zip(probabilities, order)]


def check_top_k(k: int, task: Task) -> int:
    if not 1 <= k <= len(task.classes):
        raise FeastError(f"--top-k {k} must be between 1 and the model's {len(task.classes)} classes")
    return k


def collect_files(target: str | os.PathLike[str]) -> tuple[list[Path], bool]:
    """The files ``target`` names (a file, or a folder's image files) and whether it is a folder; FeastError if none."""
    target = Path(target)
    if not target.exists():
        raise FeastError(f"{target} does not exist; give an image file or a folder of images")
    if not target.is_dir():
        return [target], False
    files = image_files(target)
    if not files:
        raise FeastError(
            f"{target} holds no image files ({', '.join(IMAGE_EXTENSIONS)}, searched recursively); "
            "give a folder of images or an image file"
        )
    return files, True


def predict(
    model: OnnxModel,
    files: Sequence[Path],
    k: int = 3,
    batch_size: int = DEFAULT_BATCH,
    *,
    skip_unreadable: bool = True,
    progress: Progress | None = None,
) -> Predictions:
    """Top-``k`` classes of each file, ``batch_size`` files per onnxruntime run; unreadable files skipped (or an error)."""
    check_top_k(k, model.task)
    if batch_size < 1:
        raise FeastError(f"--batch-size {batch_size} must be at least 1")
    items: list[Prediction] = []
    skipped: list[Skipped] = []
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        images, kept, missed = read_images(chunk, model.task)
        if missed and not skip_unreadable:
            raise ImageReadError(f"{missed[0].file}: {missed[0].reason}")
        skipped += missed
        if kept:
            tops = top_k(model.probabilities(images), k, model.task.classes)
            items += [Prediction(str(chunk[i]), top) for i, top in zip(kept, tops)]
        if progress is not None:
            progress(start + len(chunk), len(files))
    if files and not items:
        raise ImageReadError(
            f"none of the {len(files)} image file(s) could be read (e.g. {skipped[0].file}: {skipped[0].reason})"
        )
    return Predictions(tuple(items), tuple(skipped))


def predicted_classes(
    model: OnnxModel, images: torch.Tensor, batch_size: int = DEFAULT_BATCH, progress: Progress | None = None
) -> torch.Tensor:
    """The most probable task index of each uint8 image, ``batch_size`` per onnxruntime run."""
    out = []
    for start in range(0, len(images), batch_size):
        out.append(torch.from_numpy(model.probabilities(images[start : start + batch_size]).argmax(axis=1)))
        if progress is not None:
            progress(min(start + batch_size, len(images)), len(images))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


# ---------------------------------------------------------------------- evaluate


@dataclass(frozen=True)
class LabelledImages:
    """Images labelled with the task's indices: the fields of ``feast_edge.data.sources.LoadedData`` evaluate uses."""

    images: torch.Tensor  # uint8 [N, C, size, size]
    labels: torch.Tensor  # int64 [N], the task's indices
    task: Task
    source: str
    skipped: tuple[Skipped, ...]


def read_image_folder(root: str | os.PathLike[str], task: Task, progress: Progress | None = None) -> LabelledImages:
    """An image folder ``<root>/<class name>/<files>`` (files found recursively), labelled by class name."""
    root = Path(root)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder"
        raise FeastError(f"--data {root} {what}; give an image folder laid out as <folder>/<class name>/<image files>")
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not folders:
        raise FeastError(
            f"--data {root} has no class folders; lay it out as {root}/<class name>/<image files> "
            f"with the model's class names ({', '.join(task.classes[:5])}{', ...' if len(task.classes) > 5 else ''})"
        )
    index = {d: task.index_of(d.name, where=f"--data {root}") for d in folders}  # every folder checked before decoding
    files = [(f, index[d]) for d in folders for f in image_files(d)]
    loose = [
        Skipped(str(f), "not in a class folder") for f in sorted(root.iterdir()) if f.is_file() and is_image_name(f)
    ]
    if not files:
        raise FeastError(
            f"--data {root}: its class folders ({', '.join(d.name for d in folders[:5])}) hold no image files "
            f"({', '.join(IMAGE_EXTENSIONS)}); put the images in them"
        )
    images, kept, skipped = read_images([f for f, _ in files], task, progress)
    if not kept:
        raise ImageReadError(
            f"--data {root}: none of its {len(files)} image files could be read "
            f"(e.g. {skipped[0].file}: {skipped[0].reason})"
        )
    labels = torch.tensor([files[i][1] for i in kept], dtype=torch.long)
    return LabelledImages(images, labels, task, f"image folder {root}", tuple(loose + skipped))


@dataclass(frozen=True)
class ClassScore:
    """One class's examples and how many the model got right."""

    name: str
    index: int
    examples: int
    correct: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else 0.0


@dataclass(frozen=True)
class Evaluation:
    """Accuracy of a model on labelled images, overall and per class (the classes that have examples)."""

    classes: tuple[ClassScore, ...]
    skipped: int = 0

    @property
    def examples(self) -> int:
        return sum(c.examples for c in self.classes)

    @property
    def correct(self) -> int:
        return sum(c.correct for c in self.classes)

    @property
    def accuracy(self) -> float:
        return self.correct / self.examples if self.examples else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "correct": self.correct,
            "accuracy": self.accuracy,
            "skipped": self.skipped,
            "classes": [
                {
                    "class": c.name,
                    "index": c.index,
                    "examples": c.examples,
                    "correct": c.correct,
                    "accuracy": c.accuracy,
                }
                for c in self.classes
            ],
        }


def evaluate(
    model: OnnxModel,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int = DEFAULT_BATCH,
    *,
    skipped: int = 0,
    progress: Progress | None = None,
) -> Evaluation:
    """Overall and per-class accuracy of ``model`` on uint8 ``images`` with the task's indices as ``labels``."""
    if batch_size < 1:
        raise FeastError(f"--batch-size {batch_size} must be at least 1")
    if tuple(images.shape[1:]) != model.task.shape or len(images) != len(labels):
        raise FeastError(
            f"{len(images)} images of shape {tuple(images.shape[1:])} with {len(labels)} labels do not fit the "
            f"model's task {model.task.describe()}; read the data with the model's task"
        )
    classes = len(model.task.classes)
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < classes:
        raise FeastError(f"labels must be the task's indices 0..{classes - 1}; map them by class name (Task.label_map)")
    predicted = predicted_classes(model, images, batch_size, progress)
    examples = torch.bincount(labels, minlength=classes)
    correct = torch.bincount(labels[predicted == labels], minlength=classes)
    scores = tuple(
        ClassScore(name, i, int(examples[i]), int(correct[i]))
        for i, name in enumerate(model.task.classes)
        if examples[i] > 0
    )
    return Evaluation(scores, skipped)
