"""Fixtures shared by every layer: presets, reference data and the real Fashion-MNIST files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.space.preset import Preset, load_preset_file
from strategies import TINY_PRESET

# Test models are small: one intra-op thread is as fast and avoids oversubscription
# when the suite shares the machine with other work.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "reference"  # test data only (README.md there); never package data


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root (where pyproject.toml is)."""
    return REPO


@pytest.fixture(scope="session")
def tiny() -> Preset:
    return load_preset_file(TINY_PRESET)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny tensors only pay for threads, and a thread count fixes float summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def reference_cache_csv() -> Path:
    """The FEAST paper's CIFAR-100 variant cache (tests/data/reference/), the oracle of the cost, fitness and routing tests."""
    path = REFERENCE_DIR / "feast-cifar100-cache.csv"
    assert path.is_file(), f"the reference cache {path} is part of the repository; restore it (git checkout -- {path.relative_to(REPO)})"
    return path


@pytest.fixture(scope="session")
def fashion_mnist_dir() -> Path:
    # CI installs Debian's dataset-fashion-mnist; a missing data set is a setup error, not a skip.
    assert (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists() or (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte").exists(), (
        f"Fashion-MNIST is not installed in {FASHION_MNIST_DIR}: run 'apt-get install -y dataset-fashion-mnist'"
    )
    return FASHION_MNIST_DIR


class Cli:
    """A console script run as a user runs it (a subprocess), and the contract of its user errors."""

    def __init__(self, module: str) -> None:
        self.module = module

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", self.module, *args],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "160", **(env or {})},
            timeout=timeout,
            cwd=cwd,
        )

    @staticmethod
    def assert_user_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
        """Non-zero exit, no traceback, exactly one ``error:`` line on stderr that contains ``fragment``."""
        assert result.returncode != 0
        assert "Traceback" not in result.stderr + result.stdout
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="session")
def cli() -> Cli:
    """``feast-edge``, as a subprocess."""
    return Cli("feast_edge.cli")


@pytest.fixture(scope="session")
def server_cli() -> Cli:
    """``feast-server``, as a subprocess."""
    return Cli("feast_edge.server.cli")


@pytest.fixture(scope="session")
def agent_cli() -> Cli:
    """``feast-agent``, as a subprocess."""
    return Cli("feast_edge.agent.cli")
