"""The tests' simulation settings in one place: a few clients, a few hundred real Fashion-MNIST examples, rounds of seconds.

``tiny_config()`` is the simulation the protocol, resume, bit-identity, method and dashboard tests run: Fashion-MNIST
on the fmnist-tiny test preset (tests/presets, 15x fewer MACs than fmnist-small). A test changes what it is about
(``tiny_config(rounds=3, seed=3)``); the one end-to-end test per path that guards the real size passes
``preset="fmnist-small"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.sim.setup import SimulationConfig
from strategies import FMNIST_TINY

TINY = dict(
    preset=str(FMNIST_TINY),
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


def tiny_config(data_dir: Path | str = FASHION_MNIST_DIR, **changes: Any) -> SimulationConfig:
    """A tiny simulation of the Fashion-MNIST files in ``data_dir``, with ``changes`` to :data:`TINY`."""
    return SimulationConfig.of(data_dir=str(data_dir), **{**TINY, **changes})


def cli_options(config: SimulationConfig) -> list[str]:
    """``config``'s population and schedule as ``feast-edge simulate`` options (the command line has no probe_variants:
    it keeps its default)."""
    return [
        "--preset", config.preset, "--clients", str(config.population.clients), "--per-round", str(config.population.per_round),
        "--rounds", str(config.training.rounds), "--train-limit", str(config.population.train_limit),
        "--val-samples", str(config.validation.val_samples), "--calib-samples", str(config.validation.calib_samples),
        "--test-limit", str(config.test_limit), "--eval-every", str(config.validation.eval_every),
        "--batch-size", str(config.training.batch_size),
        "--seed", str(config.seed), "--data", config.data_dir, "--device", "cpu",
    ]  # fmt: skip
