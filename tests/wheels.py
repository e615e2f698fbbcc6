"""feast-edge's own wheel for the tests that install it (test_wheel, test_board_install), built one way.

The wheel is built from a copy of the repository's files (tracked, plus untracked ones git does not ignore), so a
stale ``build/`` or an editable install cannot leak into it; without build isolation (this environment's
setuptools) and without an index, so nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

IGNORED_DIRS = (
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "site",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".hypothesis",
    ".benchmarks",
    "runs",
    "feast-demo",
)


def copy_sources(repo: Path, dest: Path) -> None:
    """The repository's files (tracked, plus untracked ones git does not ignore), without build outputs or the venv."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):  # no git, not a work tree, or an owner git refuses
        shutil.copytree(repo, dest, ignore=shutil.ignore_patterns(*IGNORED_DIRS), symlinks=True)
        return
    for name in filter(None, listed.decode().split("\0")):
        source = repo / name
        if source.is_file():  # a tracked file deleted in the work tree is not part of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def build_wheel(repo: Path, folder: Path) -> tuple[Path, Path]:
    """(the copied sources, the wheel built from them) under ``folder``; an AssertionError with pip's output if it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    src, dist = folder / "src", folder / "dist"
    src.mkdir(parents=True)
    dist.mkdir()
    copy_sources(repo, src)
    argv = [sys.executable, "-m", "pip", "--isolated", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
            "-w", str(dist), str(src)]  # fmt: skip
    result = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    wheels = sorted(dist.glob("feast_edge-*.whl"))
    assert len(wheels) == 1, [p.name for p in dist.iterdir()]
    return src, wheels[0]
