"""Finding data files by name: user directories on an environment variable first, then the built-in ones."""

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
