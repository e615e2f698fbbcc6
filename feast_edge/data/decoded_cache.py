"""The decoded cache: a data source's uint8 tensors, decoded once and read back on every later start.

Where: ``$FEAST_EDGE_DATA_CACHE`` (``off`` turns the cache off), else ``$XDG_CACHE_HOME/feast-edge/data``, else
``~/.cache/feast-edge/data``. An unwritable folder is a warning: the data still loads, decoded again next time.

What: one safetensors file per source, ``labels`` (int64 ``[N]``) then ``images`` (uint8 ``[N, C, S, S]``), named by a
key: the SHA-256 of the format version, the task digest, the kind of source, its resolved path and split, and every
file's name relative to it, size, mtime_ns and mode. A file added, removed, edited, touched or chmod-ed changes the
key, so the source is read again and a stale cache is never used; the new file replaces the source's old one. The
format version changes with how files become tensors (2: turned upright by their EXIF orientation), so an entry an
older version wrote is never read, and is replaced the same way. The header's metadata holds the SHA-256 of the tensor
bytes; a file whose header, size or hash does not match (truncated, edited) is logged, deleted and rebuilt. Files are
written to a temporary name and renamed (never torn).

Incremental: an image folder's or manifest's entry also holds ``rows`` (uint8: the JSON list of each row's file,
name, size, mtime_ns and mode; hashed with the tensors). When the files change, the source's previous entry
(:meth:`CacheEntry.previous`) gives the rows of those that did not: only new and changed files are decoded, removed
ones drop out, and the tensors are those a full decode gives (same rows, same order).

Memory bound: a set of up to ``$FEAST_EDGE_DATA_MEMORY_LIMIT`` bytes of images (default 2 GiB; suffixes K, M, G, T,
powers of 1024) is held in RAM as uint8, ``N * C * S * S`` bytes (a 50,000-image 3x32x32 set: 154 MB). A larger set is
decoded straight into the cache file through a memory map and returned as a copy-on-write memory map of that file
(``numpy.memmap`` at the tensor's offset; writes to it never reach the file): RAM then holds only the pages in use. If
the cache cannot be written, a larger set is held in RAM after all, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feast_edge.data.images import DataError
from feast_edge.util.atomic import AtomicFile

log = logging.getLogger(__name__)

# 2: images are turned upright by their EXIF orientation (Task.image_tensor); a version 1 entry holds them as stored.
FORMAT_VERSION = 2
_SLOT_FORMAT = 1  # the slot hashes the source as version 1 did: every later version's entry replaces the older one
CACHE_ENV = "FEAST_EDGE_DATA_CACHE"
LIMIT_ENV = "FEAST_EDGE_DATA_MEMORY_LIMIT"
DEFAULT_LIMIT = 2 * 1024**3
MAX_HEADER = 1 << 20
MAX_ROW_BYTES = 4096  # JSON bytes per row of the rows index, at most (a name is at most 4096 bytes on Linux)
_CHUNK = 64 << 20
_STALE_TMP_S = 24 * 3600  # a temporary file this old was left by a killed run


def cache_folder(cache_dir: str | os.PathLike[str] | bool | None = None) -> Path | None:
    """The folder of the decoded cache (see the module docstring); None when the cache is off (``cache_dir=False``)."""
    if cache_dir is False:
        return None
    if cache_dir is not None and cache_dir is not True:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "feast-edge" / "data"


def memory_limit() -> int:
    """Bytes of images held in RAM before the cache file is memory-mapped instead (``$FEAST_EDGE_DATA_MEMORY_LIMIT``)."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", text.lower())
    if not match:
        raise DataError(f"{LIMIT_ENV}={text!r} is not a size; give bytes, e.g. 2G or 512M or 1000000")
    return int(float(match.group(1)) * 1024 ** " kmgt".index(match.group(2) or " "))


@dataclass(frozen=True)
class Cached:
    """Tensors read back from a cache file, with the metadata they were written with."""

    images: torch.Tensor
    labels: torch.Tensor
    metadata: dict[str, str]
    mapped: bool
    rows: list[str] | None = None  # each row's file (FileList.row_items), where the entry holds them


class _Damaged(Exception):
    pass


class _Stale(_Damaged):  # an entry of an older format: never read, not damaged either (its source's next replaces it)
    pass


@dataclass(frozen=True)
class CacheEntry:
    """One source's place in the cache: ``<folder>/<slot>-<key>.safetensors`` (the slot names the source, the key its content)."""

    folder: Path | None
    slot: str
    key: str

    @classmethod
    def of(cls, folder: Path | None, identity: dict[str, str], items: list[str]) -> CacheEntry:
        """The entry for a source named by ``identity`` (task digest, kind, path, split) whose files are ``items``."""
        key = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True).encode())
        for item in items:
            key.update(item.encode("utf-8", "surrogateescape") + b"\n")
        slot = hashlib.sha256(json.dumps({"format": _SLOT_FORMAT, **identity}, sort_keys=True).encode())
        return cls(folder, slot.hexdigest()[:16], key.hexdigest())

    @property
    def path(self) -> Path | None:
        return None if self.folder is None else self.folder / f"{self.slot}-{self.key}.safetensors"

    def previous(self, shape: tuple[int, ...]) -> Cached | None:
        """The newest other entry of this source that holds its rows index (memory-mapped, hash-checked): what an
        incremental decode reuses; None when there is none."""
        if self.folder is None:
            return None
        try:
            found = sorted(self.folder.glob(f"{self.slot}-*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
        except OSError:
            return None
        for path in reversed(found):
            key = path.name[len(self.slot) + 1 : -len(".safetensors")]
            if key == self.key or not re.fullmatch(r"[0-9a-f]{64}", key):
                continue
            cached = CacheEntry(self.folder, self.slot, key).read(shape, 0)  # limit 0: mapped, never copied into RAM
            if cached is not None and cached.rows is not None:
                return cached
        return None

    # ------------------------------------------------------------------ reading
    def read(self, shape: tuple[int, ...], limit: int) -> Cached | None:
        """The cached tensors if the file is whole and matches its hash; None (a miss) otherwise, a damaged file deleted."""
        path = self.path
        if path is None:
            return None
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the decoded cache %s (%s); decoding the images again", path, exc.strerror or exc)
            return None
        with f:
            try:
                return self._parse(f, path, shape, limit)
            except _Stale:
                return None
            except _Damaged as exc:
                log.warning("decoded cache %s is damaged (%s); decoding the images again", path, exc)
            except OSError as exc:
                log.warning(
                    "cannot read the decoded cache %s (%s); decoding the images again", path, exc.strerror or exc
                )
                return None
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def _parse(self, f: Any, path: Path, shape: tuple[int, ...], limit: int) -> Cached:
        head = f.read(8)
        if len(head) != 8:
            raise _Damaged("shorter than its header")
        size = int.from_bytes(head, "little")
        if size > MAX_HEADER:
            raise _Damaged("its header length is implausible")
        raw = f.read(size)
        if len(raw) != size:
            raise _Damaged("truncated in its header")
        try:
            header = json.loads(raw)
            meta = dict(header["__metadata__"])
            labels_spec, images_spec, rows_spec = header["labels"], header["images"], header.get("rows")
            n = int(labels_spec["shape"][0])
            b = 0 if rows_spec is None else int(rows_spec["shape"][0])
        except (ValueError, KeyError, TypeError, IndexError):
            raise _Damaged("its header is not this cache's") from None
        if meta.get("format") != str(FORMAT_VERSION):
            raise _Stale
        if meta.get("key") != self.key:
            raise _Damaged("its metadata names another source")
        try:
            if not isinstance(json.loads(meta.get("skips", "{}")), dict):
                raise ValueError
        except ValueError:
            raise _Damaged("its metadata is not JSON") from None
        item = math.prod(shape)
        pixels = 8 * n + n * item  # where the images end (and the rows index begins)
        if (
            n < 1
            or labels_spec != {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]}
            or images_spec != {"dtype": "U8", "shape": [n, *shape], "data_offsets": [8 * n, pixels]}
            or set(header) - {"labels", "images", "rows", "__metadata__"}
        ):
            raise _Damaged("its tensors are not the task's shape")
        if rows_spec is not None and (
            rows_spec != {"dtype": "U8", "shape": [b], "data_offsets": [pixels, pixels + b]}
            or not 0 < b <= MAX_ROW_BYTES * n
        ):
            raise _Damaged("its rows index is not this cache's")
        end = pixels + b
        actual = os.fstat(f.fileno()).st_size - 8 - size
        if actual != end:
            raise _Damaged(f"{'truncated' if actual < end else 'longer than its tensors'}: {actual:,} of {end:,} bytes")
        digest = hashlib.sha256()
        if n * item <= limit:
            buffer = bytearray(end)
            if f.readinto(buffer) != end:
                raise _Damaged("truncated while read")
            digest.update(buffer)
            if digest.hexdigest() != meta.get("sha256"):
                raise _Damaged("its tensors do not match their SHA-256")
            labels = torch.frombuffer(buffer, dtype=torch.int64, count=n)
            images = torch.frombuffer(buffer, dtype=torch.uint8, offset=8 * n, count=n * item).view(n, *shape)
            return Cached(images, labels, meta, mapped=False, rows=_rows(bytes(buffer[pixels:]), n, b))
        label_bytes = f.read(8 * n)
        digest.update(label_bytes)
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        if digest.hexdigest() != meta.get("sha256"):
            raise _Damaged("its tensors do not match their SHA-256")
        f.seek(8 + size + pixels)
        rows = _rows(f.read(b), n, b)
        labels = torch.from_numpy(np.frombuffer(bytearray(label_bytes), dtype=np.int64))
        mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + size + 8 * n, shape=(n, *shape))
        return Cached(torch.from_numpy(mapped), labels, meta, mapped=True, rows=rows)

    # ------------------------------------------------------------------ writing
    def target(self, count: int, shape: tuple[int, ...], limit: int) -> DecodeTarget:
        """Where ``count`` images are decoded to before :meth:`DecodeTarget.finish` writes this entry."""
        return DecodeTarget(self, count, shape, limit)


def _rows(raw: bytes, n: int, b: int) -> list[str] | None:
    """The rows index (a JSON list of ``n`` strings), None when the entry holds none; _Damaged when it is malformed."""
    try:
        rows = json.loads(raw) if b else None
    except ValueError:  # not UTF-8, not JSON
        rows = ()
    if b and not (isinstance(rows, list) and len(rows) == n and all(isinstance(r, str) for r in rows)):
        raise _Damaged("its rows index is malformed")
    return rows


def _header(n: int, shape: tuple[int, ...], meta: dict[str, str], rows: int = 0) -> bytes:
    item = math.prod(shape)
    header: dict[str, Any] = {
        "labels": {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]},
        "images": {"dtype": "U8", "shape": [n, *shape], "data_offsets": [8 * n, 8 * n + n * item]},
        "__metadata__": meta,
    }
    if rows:
        header["rows"] = {"dtype": "U8", "shape": [rows], "data_offsets": [8 * n + n * item, 8 * n + n * item + rows]}
    return json.dumps(header, separators=(",", ":")).encode()


class DecodeTarget:
    """The uint8 ``[count, C, S, S]`` array images are decoded into: RAM, or above the limit a memory map of the new cache file."""

    def __init__(self, entry: CacheEntry, count: int, shape: tuple[int, ...], limit: int) -> None:
        self.entry, self.count, self.shape = entry, count, tuple(shape)
        self.item = math.prod(shape)
        self.file: AtomicFile | None = None
        self.folder_ok = self._prepare_folder()
        if self.folder_ok and count * self.item > limit:
            try:
                self._map()
                return
            except OSError as exc:
                self._discard()
                log.warning(
                    "cannot write the decoded cache %s (%s); holding %s bytes of images in RAM instead",
                    entry.path,
                    exc.strerror or exc,
                    f"{count * self.item:,}",
                )
                self.folder_ok = False
        self.array: np.ndarray = np.empty((count, *self.shape), dtype=np.uint8)

    def _prepare_folder(self) -> bool:
        folder = self.entry.folder
        if folder is None:
            return False
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(13, "permission denied")
        except OSError as exc:
            log.warning(
                "cannot write the decoded cache in %s (%s); the images load without it and are decoded again next "
                "start (set %s to a writable folder)",
                folder,
                exc.strerror or exc,
                CACHE_ENV,
            )
            return False
        return True

    def _map(self) -> None:
        probe = _header(self.count, self.shape, _metadata_bound(self.entry), rows=10**15)  # the longest offsets
        self.reserve = -(-(len(probe) + 64) // 8) * 8  # 8 + reserve is a multiple of 8
        self.offset = 8 + self.reserve + 8 * self.count  # where the images start, whatever N turns out to be
        self.file = AtomicFile(self.entry.path)  # type: ignore[arg-type]
        self.file.file.truncate(self.offset + self.count * self.item)
        self.array = np.memmap(
            self.file.tmp, dtype=np.uint8, mode="r+", offset=self.offset, shape=(self.count, *self.shape)
        )

    def _discard(self) -> None:
        if self.file is not None:
            self.array = np.empty((0, *self.shape), dtype=np.uint8)  # drop the map before the file goes
            self.file.discard()
            self.file = None

    def abort(self) -> None:
        """Nothing is written (the decode failed or was interrupted)."""
        self._discard()

    def finish(
        self, keep: np.ndarray, labels: np.ndarray, metadata: dict[str, str], rows: list[str] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The kept rows, in order, as tensors (``labels`` are the kept rows' labels), the cache file written if it can be.

        ``rows``: each kept row's file (the rows index an incremental decode reuses), None for a source without files.
        Returns ``(images, labels, mapped)``; ``mapped`` when the images are a memory map of the cache file.
        """
        n = int(keep.sum())
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        if labels.shape != (n,) or (rows is not None and len(rows) != n):
            raise ValueError("finish: one label (and one row name) per kept image")
        _compact(self.array, keep)
        images = self.array[:n]
        meta = {**_bounded(metadata), "format": str(FORMAT_VERSION), "key": self.entry.key}
        index = b"" if rows is None else json.dumps(rows, separators=(",", ":")).encode()
        if len(index) > MAX_ROW_BYTES * n:
            index = b""  # names too long to index: this entry is whole, only the next change decodes everything
        digest = hashlib.sha256(labels.tobytes())
        for start in range(0, n, max(1, _CHUNK // max(1, self.item))):
            digest.update(np.ascontiguousarray(images[start : start + _CHUNK // max(1, self.item)]).reshape(-1).data)
        digest.update(index)
        meta["sha256"] = digest.hexdigest()
        if self.file is not None:
            return self._finish_mapped(n, labels, meta, index)
        if self.folder_ok:
            self._write(n, images, labels, meta, index)
        return torch.from_numpy(images), torch.from_numpy(labels), False

    def _write(self, n: int, images: np.ndarray, labels: np.ndarray, meta: dict[str, str], index: bytes) -> None:
        header = _header(n, self.shape, meta, len(index))
        length = -(-(8 + len(header)) // 8) * 8 - 8
        try:
            with AtomicFile(self.entry.path) as out:  # type: ignore[arg-type]
                out.file.write(length.to_bytes(8, "little") + header + b" " * (length - len(header)))
                out.file.write(labels.tobytes())
                out.file.write(np.ascontiguousarray(images).reshape(-1).data)
                out.file.write(index)
        except OSError as exc:
            log.warning(
                "cannot write the decoded cache %s (%s); decoded again next start", self.entry.path, exc.strerror or exc
            )
            return
        _tidy(self.entry)

    def _finish_mapped(
        self, n: int, labels: np.ndarray, meta: dict[str, str], index: bytes
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        assert self.file is not None
        header = _header(n, self.shape, meta, len(index))
        length = self.offset - 8 * n - 8  # the header absorbs the rows the skipped images leave unused
        if len(header) > length:
            raise ValueError("decoded cache: the header outgrew its reserve")
        self.array.flush()
        self.array = np.empty((0, *self.shape), dtype=np.uint8)
        f = self.file.file
        f.seek(0)
        f.write(length.to_bytes(8, "little") + header + b" " * (length - len(header)))
        f.write(labels.tobytes())
        f.truncate(self.offset + n * self.item)
        f.seek(self.offset + n * self.item)
        f.write(index)
        path = self.file.commit()
        self.file = None
        _tidy(self.entry)
        mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=self.offset, shape=(n, *self.shape))
        return torch.from_numpy(mapped), torch.from_numpy(labels), True


_BOUNDS = {"source": 600, "skips": 4096, "task": 64}


def _metadata_bound(entry: CacheEntry) -> dict[str, str]:
    """Metadata as long as any :meth:`DecodeTarget.finish` writes (the header's reserve is sized from it)."""
    return {"format": "9" * 8, "key": "0" * 64, "sha256": "0" * 64, **{k: "x" * n for k, n in _BOUNDS.items()}}


def _bounded(metadata: dict[str, str]) -> dict[str, str]:
    """The metadata a cache file holds: ``source``, ``skips`` and ``task`` only, each cut to its bound."""
    meta = {k: str(metadata[k])[:n] for k, n in _BOUNDS.items() if k in metadata}
    if len(metadata.get("skips", "")) > _BOUNDS["skips"]:  # cut JSON is not JSON: keep the counts, drop the names
        counts = json.loads(metadata["skips"]).get("counts", {})
        meta["skips"] = json.dumps({"counts": counts, "names": {}})[: _BOUNDS["skips"]]
    return meta


def _compact(array: np.ndarray, keep: np.ndarray) -> None:
    """Move the kept rows to the front, in order (runs of rows at a time)."""
    kept = np.flatnonzero(keep)
    if len(kept) == len(keep):
        return
    to = 0
    # Runs of consecutive kept rows: each moves as one block.
    breaks = np.flatnonzero(np.diff(kept) != 1) + 1
    for run in np.split(kept, breaks):
        if len(run) == 0:
            continue
        if run[0] != to:
            array[to : to + len(run)] = array[run[0] : run[-1] + 1]
        to += len(run)


def _tidy(entry: CacheEntry) -> None:
    """Remove this source's older cache files, and temporary files a killed run left."""
    folder = entry.folder
    if folder is None:
        return
    now = time.time()
    for old in folder.glob(f"{entry.slot}-*.safetensors"):
        if old.name != f"{entry.slot}-{entry.key}.safetensors":
            old.unlink(missing_ok=True)
    for tmp in folder.glob(f".{entry.slot}-*.tmp"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()
        except OSError:
            pass
