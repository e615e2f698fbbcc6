"""The repository is formatted by ``ruff format`` at 120 columns (pyproject.toml ``[tool.ruff]``): the check a reviewer runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_python_file_is_ruff_formatted() -> None:
    command = [sys.executable, "-m", "ruff", "format", "--check", "--output-format", "concise", "."]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    files = sorted({line.split(":")[0] for line in result.stdout.splitlines() if "unformatted" in line})
    assert result.returncode == 0, f"run `ruff format` in {REPO}; not formatted:\n" + "\n".join(files) + result.stderr
