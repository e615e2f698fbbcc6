"""What tests need at import time (hypothesis strategies, parametrize lists, the test preset's path).

Everything else the tests share is a fixture in a ``conftest.py``; these
values cannot be, because ``@given`` and ``@pytest.mark.parametrize`` read
them when a module is collected. ``pyproject.toml`` puts this folder on
``sys.path`` for pytest, so a test module writes ``from strategies import archs``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import strategies as st

from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset, available_presets, load_preset, load_preset_file

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
TINY_PRESET = PRESETS_DIR / "test-tiny.toml"
# Fashion-MNIST's task on a supernet 15x smaller than fmnist-small, with its cache beside it (fmnist-tiny.cache.json):
# the preset of the federation, Flower, resume and dashboard tests. The session and its subprocesses find it by name
# (FEAST_EDGE_PRESET_PATH, set by tests/conftest.py).
FMNIST_TINY = PRESETS_DIR / "fmnist-tiny.toml"
BUILTIN_PRESETS = sorted(available_presets())


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
    """Every built-in preset and the tiny test preset."""
    return [load_preset(name) for name in BUILTIN_PRESETS] + [load_preset_file(TINY_PRESET)]


def tiny_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random uint8 images of the tiny test preset with random labels, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 16, 16), dtype=torch.uint8, generator=g)
    return images, torch.randint(0, load_preset_file(TINY_PRESET).classes, (n,), generator=g)
