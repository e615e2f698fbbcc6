"""Shared fixtures: presets, reference data and the real Fashion-MNIST files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from feast_edge.arch import Arch
from feast_edge.data import FASHION_MNIST_DIR
from feast_edge.preset import Preset, available_presets, load_preset, load_preset_file

# Test models are small: one intra-op thread is as fast and avoids oversubscription
# when the suite shares the machine with other work.
torch.set_num_threads(1)

TESTS = Path(__file__).parent
REPO = TESTS.parent
REFERENCE_DIR = REPO.parent / "shared" / "reference"
TINY_PRESET = TESTS / "presets" / "test-tiny.toml"
BUILTIN_PRESETS = sorted(available_presets())


@pytest.fixture(scope="session")
def tiny() -> Preset:
    return load_preset_file(TINY_PRESET)


@pytest.fixture(scope="session")
def reference_cache_csv() -> Path:
    path = REFERENCE_DIR / "feast-cifar100-cache.csv"
    if not path.is_file():
        pytest.skip(f"reference cache {path} is absent (it lives in ../shared/reference beside the repository)")
    return path


@pytest.fixture(scope="session")
def fashion_mnist_dir() -> Path:
    # CI installs Debian's dataset-fashion-mnist; a missing data set is a setup error, not a skip.
    assert (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists() or (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte").exists(), (
        f"Fashion-MNIST is not installed in {FASHION_MNIST_DIR}: run 'apt-get install -y dataset-fashion-mnist'"
    )
    return FASHION_MNIST_DIR


def archs(preset: Preset) -> st.SearchStrategy[Arch]:
    """Hypothesis strategy over every valid architecture of ``preset``."""
    n = preset.num_stages
    top_w = len(preset.width_multipliers) - 1
    return st.builds(
        Arch,
        d=st.tuples(*[st.integers(0, preset.max_extra_blocks)] * n),
        e=st.tuples(*[st.sampled_from(preset.expansion_ratios)] * n),
        w=st.tuples(*[st.integers(0, top_w)] * (n + 1)),
    )


def all_presets() -> list[Preset]:
    return [load_preset(name) for name in BUILTIN_PRESETS] + [load_preset_file(TINY_PRESET)]
