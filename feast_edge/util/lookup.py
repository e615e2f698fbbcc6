"""Data files a user names: found by name (user directories on an environment variable first, then built-in), read with clear errors."""

from __future__ import annotations

import os
from pathlib import Path


def named_files(env: str, builtin: Path, pattern: str) -> dict[str, Path]:
    """Map of file stem -> file matching ``pattern``: directories listed in ``$env`` (``os.pathsep``-separated) shadow ``builtin``."""
    directories = [Path(p) for p in os.environ.get(env, "").split(os.pathsep) if p] + [builtin]
    found: dict[str, Path] = {}
    for directory in directories:
        if directory.is_dir():
            for file in sorted(directory.glob(pattern)):
                found.setdefault(file.stem, file)
    return found


def read_text(path: Path, what: str, error: type[Exception], alternative: str) -> str:
    """The UTF-8 text of ``path``; ``error`` naming the file and the fix when it is missing or unreadable.

    ``what`` names the file for people ("preset file"); ``alternative`` is the
    other way to name one ("a preset name").
    """
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        kind = f"{path.suffix} file" if path.suffix else "file"
        raise error(f"{what} {path} does not exist; pass an existing {kind} or {alternative}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} cannot be read ({exc}); check the path and its permissions") from None
