"""A data source as the task's tensors (:class:`LoadedData`), and the step every decoded source shares: cache or decode."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from feast_edge.data.decode import Progress, decode_into, default_workers
from feast_edge.data.decoded_cache import CacheEntry, cache_folder, memory_limit
from feast_edge.data.images import DataError
from feast_edge.data.skips import Skips
from feast_edge.data.task import Task

log = logging.getLogger("feast_edge.data")


@dataclass(frozen=True)
class LoadedData:
    """A source's examples in the task's form.

    ``images`` uint8 ``[N, C, S, S]`` in ``task.shape`` (above the memory limit a
    copy-on-write memory map of the decoded cache: see
    :mod:`feast_edge.data.decoded_cache`), ``labels`` int64 task indices,
    ``source`` what was read in words, ``skipped`` reason -> count of what was
    left out (:mod:`feast_edge.data.skips`), ``from_cache`` whether the decoded
    cache answered.
    """

    images: torch.Tensor
    labels: torch.Tensor
    task: Task
    source: str
    skipped: dict[str, int] = field(default_factory=dict)
    from_cache: bool = False
    key: str = ""  # what was read: the decoded cache's key of the listing (every file's name, size, mtime, mode)
    reused: int = 0  # rows an incremental decode took from the source's previous cache entry (not decoded again)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def class_counts(self) -> dict[str, int]:
        """Examples per class present, by the task's class name, in the task's order."""
        counts = torch.bincount(self.labels, minlength=len(self.task.classes)).tolist()
        return {self.task.classes[i]: int(c) for i, c in enumerate(counts) if c}


def described(label: str, n: int, labels: torch.Tensor, skips: Skips) -> str:
    classes = int(torch.unique(labels).numel()) if n else 0
    left = f", {skips.total:,} left out" if skips.total else ""
    return f"{label}: {n:,} images in {classes} {'class' if classes == 1 else 'classes'}{left}"


def report_skips(label: str, skips: Skips) -> None:
    """The console line of what a source left out (once per load, cache or not)."""
    if skips.total:
        log.warning("%s: left out %s", label, skips.summary())


def decode_cached(
    items: Sequence[Any],
    opener: Callable[[Any], Any],
    labels: np.ndarray,
    names: Sequence[str],
    *,
    task: Task,
    label: str,
    identity: dict[str, str],
    key_items: list[str],
    skips: Skips,
    cache_dir: Any = None,
    workers: int | None = None,
    progress: Progress | None = None,
    row_items: Sequence[str] | None = None,
) -> LoadedData:
    """``items`` (opened by ``opener``) as the task's tensors: from the decoded cache when it holds them, else decoded and cached.

    ``labels`` and ``names`` go with ``items`` (names show in skip messages);
    ``identity`` and ``key_items`` make the cache key; ``skips`` are what the
    listing already left out (added to what decoding leaves out). ``row_items``:
    what identifies each item's file (its line of ``key_items``); given, the
    entry indexes its rows by them, and a changed source decodes only the items
    its previous entry does not hold (:meth:`CacheEntry.previous`).
    """
    entry = CacheEntry.of(cache_folder(cache_dir), {"task": task.digest, **identity}, key_items)
    limit = memory_limit()
    cached = entry.read(task.shape, limit)
    if cached is not None:
        try:
            decoded_skips = Skips.from_json(json.loads(cached.metadata.get("skips", "{}")))
        except ValueError:
            decoded_skips = Skips()
        log.info("%s: %s decoded images read from the cache %s", label, f"{len(cached.labels):,}", entry.path)
        every = skips.merge(decoded_skips)
        report_skips(label, every)
        source = described(label, len(cached.labels), cached.labels, every)
        return LoadedData(cached.images, cached.labels, task, source, dict(every.counts), True, entry.key)
    total = len(items)
    threads = default_workers() if workers is None else max(1, int(workers))
    target = entry.target(total, task.shape, limit)
    try:
        reused, todo = (0, range(total)) if row_items is None else _reuse(entry, target.array, row_items, task)
        log.info(
            "%s: decoding %s images (%d threads)%s",
            label,
            f"{len(todo):,}",
            threads,
            f"; {reused:,} unchanged ones reused from the cache" if reused else "",
        )
        started = time.monotonic()
        if reused:  # only the new and changed files, each into its own row
            reasons: list[str | None] = [None] * total
            out = _Rows(target.array, todo)
            for i, why in zip(
                todo, decode_into(out, [items[i] for i in todo], opener, task, workers=threads, progress=progress)
            ):
                reasons[i] = why
        else:
            reasons = decode_into(target.array, items, opener, task, workers=threads, progress=progress)
        keep = np.fromiter((r is None for r in reasons), dtype=bool, count=total)
        decoded_skips = Skips()
        for name, reason in zip(names, reasons):
            if reason is not None:
                decoded_skips.add(reason, name)
        if not keep.any():
            raise DataError(
                f"{label}: none of its {total:,} image files could be decoded ({decoded_skips.summary()}); "
                "check the files (open one in an image viewer) and their permissions"
            )
        metadata = {"source": label, "skips": json.dumps(decoded_skips.to_json()), "task": task.digest}
        rows = None if row_items is None else [r for r, k in zip(row_items, keep) if k]
        images, kept_labels, mapped = target.finish(keep, np.asarray(labels, dtype=np.int64)[keep], metadata, rows)
    except BaseException:
        target.abort()
        raise
    seconds = time.monotonic() - started
    log.info(
        "%s: decoded %s images in %.1f s (%s images/s)%s",
        label,
        f"{len(todo) - (total - int(keep.sum())):,}",
        seconds,
        f"{len(todo) / max(seconds, 1e-9):,.0f}",
        f"; memory-mapped from {entry.path}" if mapped else "",
    )
    every = skips.merge(decoded_skips)
    report_skips(label, every)
    source = described(label, len(kept_labels), kept_labels, every)
    return LoadedData(images, kept_labels, task, source, dict(every.counts), False, entry.key, reused)


_COPY_ROWS = 4096  # rows copied from a previous entry at a time (a bounded temporary)


def _reuse(entry: CacheEntry, out: np.ndarray, row_items: Sequence[str], task: Task) -> tuple[int, list[int]]:
    """Copy into ``out`` the rows the source's previous cache entry holds for unchanged files; returns how many, and
    the positions still to decode (every one when there is no previous entry)."""
    previous = entry.previous(task.shape)
    if previous is None or previous.rows is None:
        return 0, list(range(len(row_items)))
    where = {item: j for j, item in enumerate(previous.rows)}
    found = [(i, where[item]) for i, item in enumerate(row_items) if item in where]
    old = previous.images.numpy()
    for start in range(0, len(found), _COPY_ROWS):
        to, of = zip(*found[start : start + _COPY_ROWS])
        out[list(to)] = old[list(of)]
    held = {i for i, _ in found}
    return len(found), [i for i in range(len(row_items)) if i not in held]


class _Rows:
    """Some rows of an array, as the array :func:`decode_into` fills (its i-th row is ``array[rows[i]]``, a view)."""

    def __init__(self, array: np.ndarray, rows: Sequence[int]) -> None:
        self.array, self.rows = array, rows
        self.shape = (len(rows), *array.shape[1:])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.array[self.rows[i]]
