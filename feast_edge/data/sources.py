"""A device's data, from any of the layouts a lab keeps it in, as the federation task's tensors: :func:`load_data`.

The kinds of ``path`` (detected in this order):

* a manifest: a ``.csv`` file of rows ``path,label`` (:mod:`feast_edge.data.scan`);
* a Fashion-MNIST IDX folder or a CIFAR-10/100 binary folder (:mod:`feast_edge.data.releases`);
* an image folder ``<root>/<class name>/<files>``, files possibly nested, PNG,
  JPEG, WebP or BMP, grey or colour, any size (:mod:`feast_edge.data.scan`). A
  root whose sub-folders are ``train/``, ``val/``, ``test/`` is laid out by split,
  and ``split`` picks one; any other root is one split, read whole.

Labels are the task's indices, by class *name*: a device holding 3 of the 10
classes gets the task's indices for those 3, and every device, and a train and
a test folder, agree by construction. Images are decoded with Pillow
(``Task.image_tensor``: grey/RGB conversion, 16-bit and palette images scaled
and converted, resize by the task's policy) in parallel threads, once: the
decoded cache (:mod:`feast_edge.data.decoded_cache`) answers the next start.

Bad input: skipped and counted (one console line with the counts and a few
names; ``LoadedData.skipped``), or stopped with a one-line DataError/TaskError
that names the problem and the fix.

=====================================================  =========================================
input                                                  what happens
=====================================================  =========================================
truncated or corrupt PNG/JPEG/WebP/BMP                 skipped: corrupt or truncated image
a non-image file (by extension or content)             skipped: not an image file
more pixels than ``PIL.Image.MAX_IMAGE_PIXELS``        skipped: too many pixels (decompression bomb)
16-bit, palette, alpha or CMYK images                  converted (not skipped)
an unreadable file (permissions)                       skipped: unreadable
an unreadable folder below a class folder              skipped: unreadable folder
a symlink loop / a folder reached twice through links  skipped: symlink loop / folder reached twice
a broken symlink                                       skipped: broken symlink
a file directly in the root (outside a class folder)   skipped: file outside a class folder
a release's examples of classes the task lacks         skipped: example of a class the task does not have
an empty class folder                                  a warning
a class folder not in the task                         stops (names the closest task classes)
a folder with no images at all, or none decodable      stops
an unreadable root or class folder                     stops
manifest row: missing file, unknown label, bad row     stops (with the line number)
a truncated or edited cache file                       detected by its hash: a warning, decoded again
an unwritable cache folder                             a warning (the data loads without the cache)
=====================================================  =========================================
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from feast_edge.data.decode import Progress, open_file
from feast_edge.data.decoded_cache import CacheEntry
from feast_edge.data.images import DataError, ImageSet, load_cifar, load_fashion_mnist, published_splits
from feast_edge.data.loaded import LoadedData, decode_cached
from feast_edge.data.releases import RELEASES, detect_release, load_release
from feast_edge.data.scan import SPLITS, FileList, folder_splits, scan_folder, scan_manifest, split_folder
from feast_edge.data.task import Task

log = logging.getLogger("feast_edge.data")

KINDS = ("image folder", "manifest", "fashion-mnist", "cifar10", "cifar100")
DATASETS = ("fashion-mnist", "cifar10", "cifar100", "imagefolder")  # feast-edge simulate --dataset
_LAYOUTS = (
    "an image folder <root>/<class name>/<file>, a manifest CSV of rows path,label, "
    "or a CIFAR binary or Fashion-MNIST IDX folder"
)

__all__ = [
    "DATASETS",
    "KINDS",
    "Listing",
    "LoadedData",
    "detect_kind",
    "load_data",
    "load_dataset",
    "load_listing",
    "scan_source",
    "splits_of",
]
GROWING = ("image folder", "manifest")  # the kinds a device adds files to: listed, then decoded (scan_source)


@dataclass(frozen=True)
class Listing:
    """An image folder's or manifest's files, listed (names, sizes, mtimes, modes), not decoded yet."""

    files: FileList
    label: str  # "image folder /data/cam" or "manifest /data/cam.csv"
    identity: dict[str, str]  # the decoded cache's name of the source (kind, path, split)

    def key(self, task: Task) -> str:
        """What :func:`load_listing` would read, as the decoded cache keys it: equal keys, the same tensors."""
        return CacheEntry.of(None, {"task": task.digest, **self.identity}, self.files.key_items()).key


def detect_kind(path: str | os.PathLike[str]) -> str:
    """What ``path`` holds: one of ``KINDS``; DataError if it is none of them."""
    path = Path(path)
    if not path.exists():
        broken = " (a broken symlink)" if path.is_symlink() else ""
        raise DataError(f"{path} does not exist{broken}; pass {_LAYOUTS}")
    if path.is_file():
        if path.suffix.lower() == ".csv":
            return "manifest"
        if path.suffix.lower() == ".safetensors":
            raise DataError(
                f"{path} is a shard file (feast-edge partition): feast-agent run --data reads it; this loader reads {_LAYOUTS}"
            )
        raise DataError(f"{path} is a file, not a manifest (.csv); pass {_LAYOUTS}")
    if not path.is_dir():
        raise DataError(f"{path} is neither a folder nor a file; pass {_LAYOUTS}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise DataError(f"cannot read {path}: permission denied; fix its permissions (chmod a+rx)")
    return detect_release(path) or "image folder"


def splits_of(path: str | os.PathLike[str], task: Task) -> tuple[str, ...]:
    """The splits ``path`` holds, in ``SPLITS`` order: those of a release whose files are there (``train``, ``test``),
    the split sub-folders of an image folder laid out by split; () for a source that is one split (a manifest, an image
    folder of class folders), which :func:`load_data` reads whole."""
    kind = detect_kind(path)
    resolved = Path(path).expanduser().resolve()
    if kind in RELEASES:
        return published_splits(resolved, kind)
    return () if kind == "manifest" else folder_splits(resolved, task)


def load_data(
    path: str | os.PathLike[str],
    task: Task,
    *,
    split: str = "train",
    cache_dir: str | os.PathLike[str] | bool | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> LoadedData:
    """``path``'s examples as ``task``'s uint8 tensors and int64 class indices (see the module docstring).

    ``split``: ``train``, ``val`` or ``test`` of a release or of an image folder
    laid out by split (ignored by a manifest and by a root that is one split).
    ``cache_dir``: the decoded cache's folder (None: the default,
    ``$FEAST_EDGE_DATA_CACHE`` or ``~/.cache/feast-edge/data``; False: no cache).
    ``workers``: decoding threads (None: the CPUs this process may use).
    ``progress(done, total)``: called as images are decoded (not on a cache hit).
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    kind = detect_kind(path)
    resolved = Path(path).expanduser().resolve()
    if kind in ("fashion-mnist", "cifar10", "cifar100"):
        return load_release(kind, resolved, task, split, cache_dir=cache_dir, workers=workers, progress=progress)
    listing = scan_source(resolved, task, split=split)
    for name in listing.files.empty:
        log.warning("%s: class folder %s/ holds no images", listing.label, name)
    return load_listing(listing, task, cache_dir=cache_dir, workers=workers, progress=progress)


def scan_source(path: str | os.PathLike[str], task: Task, *, split: str = "train", unknown: str = "stop") -> Listing:
    """The files of an image folder or manifest (``GROWING``; DataError for another kind), listed without decoding.

    ``unknown``: "stop" (a class folder or manifest label the task lacks stops it, as :func:`load_data` does) or
    "skip" (left out, and named in ``Listing.files.unknown``: a running agent's rescan refuses them and goes on).
    """
    kind = detect_kind(path)
    resolved = Path(path).expanduser().resolve()
    if kind not in GROWING:
        raise DataError(f"{resolved} is a {kind} folder; only an image folder or a manifest is listed file by file")
    if kind == "manifest":
        files = scan_manifest(resolved, task, unknown=unknown)
        return Listing(files, f"manifest {resolved}", {"kind": kind, "path": str(resolved), "split": ""})
    folder, _ = split_folder(resolved, split, task)
    files = scan_folder(folder, task, unknown=unknown)
    return Listing(files, f"image folder {folder}", {"kind": kind, "path": str(folder), "split": ""})


def load_listing(
    listing: Listing,
    task: Task,
    *,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> LoadedData:
    """``listing``'s files as the task's tensors: from the decoded cache, else decoded, only the files the source's
    previous cache entry does not hold (incremental: :mod:`feast_edge.data.decoded_cache`)."""
    files = listing.files
    return decode_cached(
        files.paths,
        open_file,
        files.label_array(),
        files.names,
        task=task,
        label=listing.label,
        identity=listing.identity,
        key_items=files.key_items(),
        skips=files.skips,
        cache_dir=cache_dir,
        workers=workers,
        progress=progress,
        row_items=files.row_items(),
    )


def load_dataset(name: str, root: str | os.PathLike[str], split: str, task: Task) -> ImageSet:
    """One split of ``feast-edge simulate --dataset NAME`` (``DATASETS``).

    ``fashion-mnist`` and ``cifar10``/``cifar100`` are read as published (their
    tensors and labels exactly); ``imagefolder`` reads ``root/<split>/<class>/``
    through :func:`load_data`, labelled by the task's class names.
    """
    if name == "fashion-mnist":
        return load_fashion_mnist(root, split)
    if name in ("cifar10", "cifar100"):
        return load_cifar(root, name, split)
    if name == "imagefolder":
        if not (Path(root) / split).is_dir():
            raise DataError(
                f"image folder {Path(root) / split} does not exist; lay out images as {root}/{split}/<class name>/<file>"
            )
        data = load_data(Path(root) / split, task)
        return ImageSet(data.images, data.labels, task.classes)
    raise DataError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
