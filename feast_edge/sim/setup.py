"""The harness's inputs, built once per process: a simulation's settings, its data splits, population and client plans.

:class:`SimulationConfig` (``feast_edge.sim.config``) is everything that decides a simulation's result;
:func:`build_setup` turns it into a :class:`Setup` (server-held validation and
calibration splits, the client pool, the population's budgets and shards, each
client's plan). The simulation (``feast_edge.sim.simulate``), its ``--nproc``
workers (``feast_edge.sim.distributed``), the methods, the partition files
(``feast_edge.sim.shards``), replay and the demo all build from here, so every
one of them sees the same clients with the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.data.holdout import holdout_split
from feast_edge.data.images import DataError, ImageSet
from feast_edge.data.sources import load_dataset
from feast_edge.local.precision import set_deterministic
from feast_edge.route.plans import plan_client
from feast_edge.sim.concerns import DEFAULT_HOLDOUT, VALIDATE_ON
from feast_edge.sim.config import SimulationConfig, SimulationError
from feast_edge.sim.growth import Growth
from feast_edge.sim.population import Population, build_population, server_split, zipf_population
from feast_edge.space.preset import Preset, load_preset

__all__ = ["DEFAULT_HOLDOUT", "VALIDATE_ON", "Setup", "SimulationConfig", "SimulationError", "build_setup"]

# Stream tags of the one-off random draws (rounds use feast_edge.run.cohort's streams).
_SPLIT, _POPULATION = 11, 12
HOLDOUT_SEED = 0  # the seed of each client's held-out split: the device agent's (LocalClient.with_holdout)
TEST_SEED = 1  # the seed of each client's test split (simulation only: set apart before the held-out split)


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed, tag])


@dataclass
class Setup:
    """Everything built once from the config: data, population, cache, client plans."""

    preset: Preset
    cache: VariantCache
    train_set: ImageSet  # the data set's training split: the server-held splits and the client pool index into it
    test_set: ImageSet
    validation: np.ndarray
    calibration: np.ndarray
    pool: np.ndarray
    population: Population
    client_ids: list[str]
    plans: dict[str, Any] = field(default_factory=dict)
    holdout: float = 0.0  # each client's held-out share of its shard (config.serving.holdout): never trains
    test_split: float = 0.0  # each client's test share of its shard (config.serving.test_split), set apart first
    growth: Growth | None = None  # clients that join and shards that grow (None: everyone, whole shards, from round 1)

    def _index(self, client_id: str) -> torch.Tensor:
        shard = self.pool[self.population.partition.shards[self.client_ids.index(client_id)]]
        return torch.tensor(np.asarray(shard), dtype=torch.long)

    def _shard(self, client_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._index(client_id)
        return self.train_set.images[index], self.train_set.labels[index]

    def _parts(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(training, held-out, test) positions into a shard of ``labels``: the test split first (``test_split``, per
        class), then the held-out split of the rest (so without a test split, exactly the held-out split it was)."""
        rest, test = torch.arange(len(labels)), torch.zeros(0, dtype=torch.long)
        if self.test_split:
            rest, test = holdout_split(labels, self.test_split, TEST_SEED)
        train, held = holdout_split(labels[rest], self.holdout, HOLDOUT_SEED)
        return rest[train], rest[held], test

    def client_data(self, client_id: str, t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's training examples: its shard, less its held-out split when ``holdout`` > 0 (and its test
        split when ``test_split`` > 0); at step ``t``, those it holds then where shards grow (feast_edge.sim.growth;
        None: all of them)."""
        images, labels = self._shard(client_id)
        if self.holdout or self.test_split:
            train = self._parts(labels)[0]
            images, labels = images[train], labels[train]
        if t is None or self.growth is None:
            return images, labels
        shown = self.growth.revealed(client_id, self.client_ids.index(client_id), t, labels)
        return images[shown], labels[shown]

    def training_size(self, client_id: str) -> int:
        """How many training examples the client's whole shard holds (its held-out and test splits aside)."""
        labels = self.train_set.labels[self._index(client_id)]
        return len(labels) if not (self.holdout or self.test_split) else len(self._parts(labels)[0])

    def client_holdout(self, client_id: str, t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's own held-out examples (none when ``holdout`` is 0): the device agent's split of its shard; at
        step ``t``, of a client whose class mix drifts, those of the classes it holds then."""
        images, labels = self._shard(client_id)
        held = self._parts(labels)[1]
        return self._of_classes_held(client_id, t, images[held], labels[held])

    def client_test(self, client_id: str, t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's test examples (none when ``test_split`` is 0): never trained, validated or gated on; at step
        ``t``, of a client whose class mix drifts, those of the classes it holds then."""
        images, labels = self._shard(client_id)
        test = self._parts(labels)[2]
        return self._of_classes_held(client_id, t, images[test], labels[test])

    def _of_classes_held(
        self, client_id: str, t: int | None, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if t is None or self.growth is None or client_id not in self.growth.drifting:
            return images, labels
        held = torch.unique(self.client_data(client_id, t)[1])
        keep = torch.isin(labels, held)
        return images[keep], labels[keep]

    def calibration_images(self) -> torch.Tensor:
        """The server-held BN-calibration images (method §8), in their fixed order."""
        return self.train_set.images[torch.tensor(np.asarray(self.calibration), dtype=torch.long)]

    def validation_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The server-held validation images and labels (checkpoint selection)."""
        index = torch.tensor(np.asarray(self.validation), dtype=torch.long)
        return self.train_set.images[index], self.train_set.labels[index]


def build_setup(config: SimulationConfig) -> Setup:
    """Load data, hold out server splits, draw the population and plan every client (and set the kernels' determinism)."""
    if config.deterministic:  # every process of a run builds its setup here, workers of --nproc too
        set_deterministic()
    preset = load_preset(config.preset)
    cache = load_cache(preset, config.cache)
    # imagefolder: --data/train and --data/test labelled by the task's class names, so the two agree by construction.
    train = load_dataset(config.dataset, config.data_dir, "train", preset.task)
    test = load_dataset(config.dataset, config.data_dir, "test", preset.task)
    shape = tuple(train.images.shape[1:])
    if shape != (preset.in_channels, preset.input_size, preset.input_size):
        raise DataError(
            f"data set {config.dataset} has images {shape}, preset {preset.name} takes {(preset.in_channels, preset.input_size, preset.input_size)}; choose a matching --preset"
        )
    if int(train.labels.max()) >= preset.classes:
        raise DataError(
            f"data set {config.dataset} has {int(train.labels.max()) + 1} classes, preset {preset.name} classifies {preset.classes}; choose a matching --preset"
        )
    split = server_split(
        len(train),
        _rng(config.seed, _SPLIT),
        n_val=config.validation.val_samples,
        n_calib=config.validation.calib_samples,
    )
    pool = split.train
    if config.population.train_limit is not None:
        if config.population.train_limit < 10 * config.population.clients:
            raise SimulationError(
                f"--train-limit {config.population.train_limit} is too small for {config.population.clients} clients (each needs >= 10 examples)"
            )
        pool = np.sort(_rng(config.seed, _SPLIT + 100).permutation(pool)[: config.population.train_limit])
    labels = train.labels.numpy()[pool]
    rng = _rng(config.seed, _POPULATION)
    b_min = preset.budget_min if config.population.budget_min is None else config.population.budget_min
    b_max = preset.budget_max if config.population.budget_max is None else config.population.budget_max
    b_cap = preset.budget_cap if config.population.budget_cap is None else config.population.budget_cap
    if config.population.budgets is not None:
        population = build_population(
            labels,
            config.population.budgets,
            rng,
            gamma=config.population.gamma,
            alpha_eff=config.population.alpha_eff,
            b_cap=b_cap,
        )
    else:
        population = zipf_population(
            labels,
            config.population.clients,
            rng,
            s=config.population.zipf_s,
            b_min=b_min,
            b_max=b_max,
            gamma=config.population.gamma,
            alpha_eff=config.population.alpha_eff,
            b_cap=b_cap,
        )
    # Zipf budgets can land anywhere from budget_min up, so the floor itself must be affordable.
    low = (
        float(np.min(population.budgets))
        if config.population.budgets is not None
        else min(b_min, float(np.min(population.budgets)))
    )
    if low < cache.smallest.macs:
        raise SimulationError(
            cache.below_smallest(low, f"raise the budgets (--budget-min) to at least {cache.smallest.macs}")
        )
    ids = [f"client-{i:03d}" for i in range(config.population.clients)]
    setup = Setup(
        preset,
        cache,
        train,
        test,
        split.validation,
        split.calibration,
        pool,
        population,
        ids,
        holdout=config.serving.holdout,
        test_split=config.serving.test_split,
    )
    setup.plans = {cid: plan_client(cache, float(b)) for cid, b in zip(ids, population.budgets)}
    if config.population.over_time:
        sizes = [setup.training_size(cid) for cid in ids]
        setup.growth = Growth.of(config.population, ids, sizes, config.seed)
    return setup
