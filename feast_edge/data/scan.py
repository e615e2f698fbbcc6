"""Listing a device's image files: an image folder ``<root>/<class name>/...`` or a manifest CSV ``path,label``.

Nothing is decoded here: the listing is each file's path, its task label (by
class *name*, through ``Task.index_of``) and its size, mtime and mode (the
decoded cache's key), plus what was left out (:mod:`feast_edge.data.skips`).

Image folder: every visible sub-folder of the root is a class, named as in the
task; its image files may sit in nested folders. Files and folders whose names
start with ``.`` are ignored. Image files are recognised by extension
(``IMAGE_EXTENSIONS``, any case). Links are followed; a folder reached again
(a symlink loop, or a second link to a folder already read) is skipped by its
``(st_dev, st_ino)``.

Manifest: rows ``path,label`` (an optional header row ``path,label``; blank
rows ignored); a relative path is relative to the CSV's folder; the label is a
class name of the task (a preset without ``class_names`` names its classes
``0``, ``1``, ..., so integer labels work there).
"""

from __future__ import annotations

import csv
import errno
import io
import os
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from feast_edge.data import skips as why
from feast_edge.data.images import DataError
from feast_edge.data.skips import Skips
from feast_edge.data.task import Task, TaskError
from feast_edge.util.text import printable

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
SPLITS = ("train", "val", "test")
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
LAYOUT = "lay out images as {root}/<class name>/<file> (PNG, JPEG, WebP or BMP)"


@dataclass
class FileList:
    """Image files to decode, with their task labels and what identifies each one's content (size, mtime, mode)."""

    kind: str  # "image folder" or "manifest"
    root: Path  # the folder (or manifest file) read, resolved
    paths: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # as shown to people and keyed in the cache: relative to the root
    labels: list[int] = field(default_factory=list)
    stats: list[tuple[int, int, int]] = field(default_factory=list)  # (size, mtime_ns, mode)
    skips: Skips = field(default_factory=Skips)
    extra_key: tuple[str, ...] = ()  # what else identifies the listing (the manifest file's own stat)
    empty: list[str] = field(default_factory=list)  # class folders that hold no image file
    unknown: list[str] = field(default_factory=list)  # class folders (manifest labels) the task lacks, left out

    def add(self, path: str, name: str, label: int, st: os.stat_result) -> None:
        self.paths.append(path)
        self.names.append(name)
        self.labels.append(label)
        self.stats.append((st.st_size, st.st_mtime_ns, st.st_mode))

    def label_array(self) -> np.ndarray:
        return np.asarray(self.labels, dtype=np.int64)

    def row_items(self) -> list[str]:
        """One line per file (name, size, mtime, mode): what identifies its content in the decoded cache."""
        return [f"{n}\0{s}\0{m}\0{o}" for n, (s, m, o) in zip(self.names, self.stats)]

    def key_items(self) -> list[str]:
        """What a cache key hashes: the listing's own identity, then one line per file (:meth:`row_items`)."""
        return [*self.extra_key, *self.row_items()]


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _nfc(name: str) -> str:
    # macOS writes folder names decomposed (NFD); the task's names are compared composed.
    return unicodedata.normalize("NFC", name)


def _entries(folder: str) -> list[os.DirEntry[str]]:
    with os.scandir(folder) as it:
        return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)


def folder_splits(root: Path, task: Task) -> tuple[str, ...]:
    """The splits an image folder is laid out by (its sub-folders, in ``SPLITS`` order), () for a root that is one split.

    A root is laid out by split when its visible sub-folders are all split names
    and are not all class names of the task.
    """
    try:
        folders = [e.name for e in _entries(str(root)) if e.is_dir()]
    except PermissionError:
        raise DataError(
            f"cannot read image folder {root}: permission denied; fix its permissions (chmod a+rx)"
        ) from None
    except OSError as exc:
        raise DataError(f"cannot read image folder {root} ({exc.strerror or exc}); check the path") from None
    by_split = bool(folders) and all(f in SPLITS for f in folders) and not all(f in task.classes for f in folders)
    return tuple(s for s in SPLITS if s in folders) if by_split else ()


def split_folder(root: Path, split: str, task: Task) -> tuple[Path, str]:
    """The folder holding the class folders: ``root/<split>`` when ``root`` is laid out by split (:func:`folder_splits`),
    else ``root`` itself."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    folders = folder_splits(root, task)
    if not folders:
        return root, ""
    if split not in folders:
        raise DataError(
            f"image folder {root} is laid out by split ({', '.join(f + '/' for f in sorted(folders))}) but has no {split}/; "
            f"add {root}/{split}/<class name>/<file> or pass the folder of that split"
        )
    return root / split, f"{split}/"


def scan_folder(root: Path, task: Task, *, unknown: str = "stop") -> FileList:
    """Every image file under ``root/<class>/``, labelled by the class folder's name (see the module docstring).

    A class folder the task lacks stops the scan (TaskError naming the closest classes); with ``unknown="skip"`` it
    is left out and named in ``FileList.unknown`` (a running agent's rescan: it refuses the folder and goes on).
    """
    listing = FileList("image folder", root)
    try:
        top = _entries(str(root))
        root_id = _ident(os.stat(root))
    except PermissionError:
        raise DataError(
            f"cannot read image folder {root}: permission denied; fix its permissions (chmod a+rx)"
        ) from None
    except OSError as exc:
        raise DataError(f"cannot read image folder {root} ({exc.strerror or exc}); check the path") from None
    classes: list[tuple[os.DirEntry[str], int, tuple[int, int]]] = []
    strange: list[str] = []  # class folders the task does not have
    for entry in top:
        kind, st = _kind(entry)
        if kind == "dir":
            if _nfc(entry.name) in task.classes:
                classes.append((entry, task.classes.index(_nfc(entry.name)), _ident(st)))  # type: ignore[arg-type]
            else:
                strange.append(entry.name)
        elif kind == "broken":
            listing.skips.add(why.BROKEN_LINK, entry.name)
        elif kind == "loop":
            listing.skips.add(why.SYMLINK_LOOP, entry.name)
        elif kind == "unreadable":
            listing.skips.add(why.UNREADABLE, entry.name)
        else:
            listing.skips.add(why.OUTSIDE_CLASS, entry.name)
    listing.unknown = [printable(f, why.NAME_CHARS) for f in strange]
    if strange and unknown == "stop":  # every folder the task lacks in one line: the first with the closest names
        shown = listing.unknown  # a name may hold a newline: the error stays one line
        others = f" (nor are {', '.join(f + '/' for f in shown[1:6])}{', ...' if len(strange) > 6 else ''})"
        try:
            task.index_of(_nfc(strange[0]), where=f"image folder {printable(str(root))}: folder {shown[0]}/")
        except TaskError as exc:
            raise TaskError(str(exc) + (others if len(strange) > 1 else "")) from None
    # Class folders are claimed first, so a link from one class into another counts as reached twice, not as images
    # of the class that links to it.
    visited = {root_id, *(ident for _, _, ident in classes)}
    for entry, label, ident in classes:
        before = len(listing.paths)
        try:
            _walk(listing, entry.path, entry.name, label, frozenset({root_id, ident}), visited)
        except OSError as exc:
            raise DataError(
                f"cannot read class folder {entry.path} ({exc.strerror or exc}); fix its permissions (chmod a+rx) or remove it"
            ) from None
        if len(listing.paths) == before:
            listing.empty.append(entry.name)
    if not listing.paths:
        detail = f" (left out: {listing.skips.summary()})" if listing.skips.total else ""
        found = "no class folders" if not classes else "no image files in its class folders"
        raise DataError(f"image folder {root} holds {found}{detail}; {LAYOUT.format(root=root)}")
    return listing


def _ident(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _kind(entry: os.DirEntry[str]) -> tuple[str, os.stat_result | None]:
    """``dir``, ``file``, ``other``, ``broken`` (a link to nothing), ``loop`` (links round a cycle) or ``unreadable``,
    following links, with the target's stat."""
    try:
        st = entry.stat()  # follows links
    except FileNotFoundError:
        return ("broken" if entry.is_symlink() else "other"), None
    except OSError as exc:  # a link that points at itself, or round a cycle of links, is a loop, not unreadable
        return ("loop" if exc.errno == errno.ELOOP else "unreadable"), None
    if stat.S_ISDIR(st.st_mode):
        return "dir", st
    if stat.S_ISREG(st.st_mode):
        return "file", st
    return "other", st


def _walk(
    listing: FileList,
    folder: str,
    rel: str,
    label: int,
    ancestors: frozenset[tuple[int, int]],
    visited: set[tuple[int, int]],
) -> None:
    """Add the image files below class folder ``folder``: OSError if it cannot be read, an unreadable folder below it is skipped."""
    stack = [(folder, rel, ancestors)]
    first = True
    while stack:
        here, here_rel, above = stack.pop()
        try:
            entries = _entries(here)
        except OSError:
            if first:
                raise
            listing.skips.add(why.UNREADABLE_FOLDER, here_rel + "/")
            continue
        first = False
        below = []
        for entry in entries:
            name = f"{here_rel}/{entry.name}"
            kind, st = _kind(entry)
            if kind == "dir":
                ident = _ident(st)  # type: ignore[arg-type]
                if ident in above:
                    listing.skips.add(why.SYMLINK_LOOP, name + "/")
                elif ident in visited:
                    listing.skips.add(why.LINKED_TWICE, name + "/")
                else:
                    visited.add(ident)
                    below.append((entry.path, name, above | {ident}))
            elif kind == "file":
                if is_image_name(entry.name):
                    listing.add(entry.path, name, label, st)  # type: ignore[arg-type]
                else:
                    listing.skips.add(why.NOT_IMAGE, name)
            elif kind == "broken":
                listing.skips.add(why.BROKEN_LINK, name)
            elif kind == "loop":
                listing.skips.add(why.SYMLINK_LOOP, name)
            elif kind == "unreadable":
                listing.skips.add(why.UNREADABLE, name)
            else:
                listing.skips.add(why.NOT_IMAGE, name)
        stack.extend(reversed(below))  # depth first, in name order


def scan_manifest(path: Path, task: Task, *, unknown: str = "stop") -> FileList:
    """The rows of a manifest CSV (see the module docstring); a missing file or an unknown label stops with its line
    (with ``unknown="skip"``, a row of a label the task lacks is left out and its label named in ``FileList.unknown``)."""
    listing = FileList("manifest", path)
    try:
        st = os.stat(path)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise DataError(f"manifest {path} is {st.st_size:,} bytes; a manifest holds at most {MAX_MANIFEST_BYTES:,}")
        text = path.read_bytes().decode("utf-8-sig")
    except PermissionError:
        raise DataError(f"cannot read manifest {path}: permission denied; fix its permissions") from None
    except UnicodeDecodeError as exc:
        raise DataError(
            f"manifest {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise DataError(f"cannot read manifest {path} ({exc.strerror or exc})") from None
    listing.extra_key = (f"manifest\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}",)
    base = path.parent
    reader = csv.reader(io.StringIO(text, newline=""))
    seen_row = False
    try:
        for row in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            cells = [cell.strip() for cell in row]
            if not seen_row:
                seen_row = True
                if [c.lower() for c in cells] == ["path", "label"]:
                    continue
            where = f"manifest {path} line {line}"
            if len(cells) != 2:
                raise DataError(f"{where}: {len(cells)} columns; each row is 'path,label'")
            name, label_name = cells
            if not name:
                raise DataError(f"{where}: the path is empty; each row is 'path,label'")
            if unknown == "skip" and _nfc(label_name) not in task.classes:
                if printable(label_name, why.NAME_CHARS) not in listing.unknown:
                    listing.unknown.append(printable(label_name, why.NAME_CHARS))
                continue
            label = task.index_of(_nfc(label_name), where=where)
            file = Path(name) if os.path.isabs(name) else base / name
            try:
                fst = os.stat(file)
            except FileNotFoundError:
                raise DataError(
                    f"{where}: {name} does not exist (relative paths are relative to {base}); fix the path or remove the row"
                ) from None
            except OSError:
                listing.skips.add(why.UNREADABLE, name)
                continue
            if stat.S_ISDIR(fst.st_mode):
                raise DataError(f"{where}: {name} is a folder; a row names one image file")
            if not stat.S_ISREG(fst.st_mode) or not is_image_name(name):
                listing.skips.add(why.NOT_IMAGE, name)
                continue
            listing.add(str(file), name, label, fst)
    except csv.Error as exc:
        raise DataError(
            f"manifest {path} line {reader.line_num}: not valid CSV ({exc}); each row is 'path,label'"
        ) from None
    if not listing.paths:
        detail = f" (left out: {listing.skips.summary()})" if listing.skips.total else ""
        raise DataError(f"manifest {path} lists no image files{detail}; write one 'path,label' row per image")
    return listing
