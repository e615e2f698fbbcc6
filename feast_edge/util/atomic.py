"""Crash-safe file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from feast_edge.errors import FeastError


class OutputPathError(FeastError, OSError):
    """An output path cannot be written."""


class DiskFullError(OutputPathError):
    """A write failed for lack of space (ENOSPC, EDQUOT): the file it would have replaced is intact."""


FULL = (errno.ENOSPC, errno.EDQUOT)


def check_writable(path: str | os.PathLike[str], what: str, flag: str = "--out") -> Path:
    """Fail early, with a fix, if ``path`` cannot be created or replaced."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OutputPathError(f"cannot write the {what} to {path}: it is a directory; pass a file path to {flag}")
    if not parent.is_dir():
        raise OutputPathError(
            f"cannot write the {what} to {path}: directory {parent} does not exist; create it or choose another {flag}"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"cannot write the {what} to {path}: directory {parent} is not writable; fix its permissions or choose another {flag}"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(
            f"cannot write the {what} to {path}: the file is read-only; fix its permissions or choose another {flag}"
        )
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename over ``path``."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    except OSError as exc:
        if exc.errno in FULL:
            raise DiskFullError(f"cannot write {path}: no space left on device") from None
        raise
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the file ordinary permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in FULL:
            raise DiskFullError(f"cannot write {path}: no space left on device ({len(data):,} bytes)") from None
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


class AtomicFile:
    """A temporary file beside ``path`` that becomes ``path`` on :meth:`commit` (fsynced, then renamed) or vanishes on :meth:`discard`.

    For writes too large for one ``bytes`` (or written through a memory map of
    :attr:`tmp`); as a context manager it commits on success and discards on an exception.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        parent = self.path.parent if str(self.path.parent) else Path(".")
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=parent)
        self.tmp = Path(tmp)
        try:
            os.fchmod(fd, 0o666 & ~_umask())
            self.file = os.fdopen(fd, "w+b")
        except BaseException:
            os.close(fd)
            self.tmp.unlink(missing_ok=True)
            raise

    def commit(self) -> Path:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        try:
            dir_fd = os.open(self.path.parent if str(self.path.parent) else ".", os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
        return self.path

    def discard(self) -> None:
        try:
            self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()
