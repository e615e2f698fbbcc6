"""Tiny simulation settings the tests share: a few clients, a few hundred examples, rounds of seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from feast_edge.sim.setup import SimulationConfig

TINY = dict(
    clients=4,
    per_round=2,
    rounds=2,
    train_limit=240,
    val_samples=100,
    calib_samples=50,
    test_limit=100,
    eval_every=2,
    probe_variants=1,
    batch_size=32,
)


def tiny_config(data_dir: Path, **changes: Any) -> SimulationConfig:
    """A tiny simulation of Fashion-MNIST in ``data_dir``, with ``changes`` to :data:`TINY`."""
    return SimulationConfig(data_dir=str(data_dir), **{**TINY, **changes})
