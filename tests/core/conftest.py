"""Fixtures shared by the core tests: the fmnist-small preset and its initial supernet state."""

from __future__ import annotations

import pytest

from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet


@pytest.fixture(scope="module")
def preset():
    return load_preset("fmnist-small")


@pytest.fixture(scope="module")
def global_state(preset):
    return Supernet(preset, seed=0).state_dict()
