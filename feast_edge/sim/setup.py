"""The harness's inputs, built once per process: a simulation's settings, its data splits, population and client plans.

:class:`SimulationConfig` is everything that decides a simulation's result;
:func:`build_setup` turns it into a :class:`Setup` (server-held validation and
calibration splits, the client pool, the population's budgets and shards, each
client's plan). The simulation (``feast_edge.sim.simulate``), its ``--nproc``
workers (``feast_edge.sim.distributed``), the methods, the partition files
(``feast_edge.sim.shards``), replay and the demo all build from here, so every
one of them sees the same clients with the same data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.aggregate.weights import ratio_problem
from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.data.holdout import MAX_HOLDOUT, holdout_split
from feast_edge.data.images import FASHION_MNIST_DIR, DataError, ImageSet
from feast_edge.data.sources import load_dataset
from feast_edge.errors import FeastError
from feast_edge.local.precision import AMP_MODES, set_deterministic
from feast_edge.local.recipe import TrainConfig, TrainError, preset_recipe
from feast_edge.personalize.select import Choice, PersonalizeError
from feast_edge.privacy.private_rounds import check_plan
from feast_edge.privacy.settings import DpSettings, PrivacyError, check_composes, dp_of
from feast_edge.route.plans import plan_client
from feast_edge.run.settings import RunError, check_run_options, recorded_of, server_opt_of
from feast_edge.sim.population import Population, build_population, server_split, zipf_population
from feast_edge.sim.registry import method_class
from feast_edge.space.preset import Preset, load_preset

_AGGREGATION = ("aggregation", "trim", "clip_norm")
_SERVER_OPT = ("server_opt", "server_lr", "server_momentum", "server_betas", "server_tau")
# Stream tags of the one-off random draws (rounds use feast_edge.run.cohort's streams).
_SPLIT, _POPULATION = 11, 12
HOLDOUT_SEED = 0  # the seed of each client's held-out split: the device agent's (LocalClient.with_holdout)
VALIDATE_ON = ("server", "devices")  # --validate-on
DEFAULT_HOLDOUT = 0.1  # --holdout with --personalize: the device agent's share of its own data


class SimulationError(FeastError, ValueError):
    """A simulation cannot start or resume with the given settings."""


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that decides a simulation's result (``device`` aside)."""

    preset: str = "fmnist-small"
    dataset: str = "fashion-mnist"
    data_dir: str = str(FASHION_MNIST_DIR)
    clients: int = 20
    per_round: int = 5
    rounds: int = 30
    gamma: float = 1.0
    zipf_s: float = 1.2
    alpha_eff: float = 0.45
    budget_min: float | None = None  # default: the preset's [population] values
    budget_max: float | None = None
    budget_cap: float | None = None
    budgets: tuple[float, ...] | None = None  # explicit budgets instead of Zipf (e.g. from device profiles)
    seed: int = 0
    method: str = "feast"  # feast_edge.sim.methods.METHODS
    method_options: tuple[tuple[str, str], ...] = ()  # --method-option KEY=VALUE pairs, sorted by key
    variants: str = "full"  # FEAST's ablation switch (method §7)
    # Training recipe: None takes the preset's [train] value (method §7's where the preset is silent).
    lr: float | None = None
    batch_size: int | None = None
    augment: str | bool | None = None  # feast_edge.local.augment.POLICIES (True/False: method §7's policy / none)
    epochs: int | None = None  # local epochs per round
    lr_schedule: str | None = None  # cosine or constant, over the federation horizon
    recipe: tuple[tuple[str, Any], ...] = ()  # further [train] keys to override (--recipe KEY=VALUE), sorted
    eval_every: int = 5
    val_samples: int = 5000
    calib_samples: int = 500
    train_limit: int | None = None  # client pool size (None: all remaining training data)
    test_limit: int | None = None
    probe_variants: int = 3  # cached variants, evenly spaced by rank, averaged for checkpoint selection
    cache: str | None = None  # cache JSON (None: beside the preset's own file, else the shipped one)
    aggregation: str = "mean"  # mean (method §6), clip, trimmed-mean or median (feast_edge.aggregate.robust)
    trim: float = 0.1  # trimmed-mean: share of the covering values dropped at each end of a position
    clip_norm: float | None = None  # clip: L2 bound of an update (None: the cohort's median update norm)
    device: str = "cpu"
    payload_dtype: str = "float32"  # payloads as the wire carries them: routed states and updates rounded to it (the model stays float32)
    amp: str = "off"  # mixed precision of local training (feast_edge.local.precision; the CLI stores what --amp resolved to on --device)
    deterministic: bool = False  # deterministic PyTorch kernels in every process of the run (CUDA; the CPU already is)
    max_weight_ratio: float = (
        0.0  # > 0: the shard sizes count as self-reported and are capped (feast_edge.aggregate.weights)
    )
    # The server's step from each round's aggregate (feast_edge.aggregate.server_opt); avg with lr 1 is the paper's.
    server_opt: str = "avg"
    server_lr: float | None = None  # None: the rule's default (feast_edge.aggregate.server_opt.DEFAULT_LR)
    server_momentum: float = 0.9
    server_betas: tuple[float, ...] = (0.9, 0.99)
    server_tau: float = 1e-3
    # After the last round, each client's personal model (feast_edge.personalize): auto, off, METHOD or METHOD:STRENGTH.
    personalize: str = "off"
    holdout: float = 0.0  # each client's held-out share of its shard (never trains), which personalize measures on
    # Who validates (checkpoint selection): the server's held split, or the cohort's held-out splits (a server without
    # data: the served-round rule, feast_edge.evaluate.served_round).
    validate_on: str = "server"
    # Client-level differential privacy (feast_edge.privacy, docs/privacy.md): dp_clip and dp_noise together, or neither.
    dp_clip: float | None = None
    dp_noise: float | None = None
    dp_delta: float | None = None  # None: 1e-5 or 0.1/clients, whichever is smaller
    dp_epsilon: float | None = None  # the privacy budget; None: no limit
    dp_seed: int | None = None  # None: noise from the OS (not reproducible)
    dp_mode: str = "central"
    dp_clip_quantile: float | None = None  # adaptive clipping toward this quantile of the update norms; None: fixed
    dp_clip_lr: float = 0.2
    dp_clip_count_std: float | None = None  # None: a tenth of the privacy on the unclipped count

    def __post_init__(self) -> None:
        if self.budgets is not None:
            object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        object.__setattr__(self, "server_betas", tuple(float(b) for b in self.server_betas))
        object.__setattr__(
            self, "method_options", tuple(sorted((str(k), str(v)) for k, v in dict(self.method_options).items()))
        )
        object.__setattr__(
            self,
            "recipe",
            tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in dict(self.recipe).items())),
        )
        checks = [
            (self.clients >= 2, f"--clients {self.clients} must be at least 2"),
            (
                1 <= self.per_round <= self.clients,
                f"--per-round {self.per_round} must be between 1 and --clients ({self.clients})",
            ),
            (self.rounds >= 1, f"--rounds {self.rounds} must be at least 1"),
            (self.gamma >= 0, f"--gamma {self.gamma} must be >= 0 (0: data independent of budget, 1: proportional)"),
            (self.zipf_s > 0, f"--zipf-s {self.zipf_s} must be > 0"),
            (self.alpha_eff > 0, f"--alpha-eff {self.alpha_eff} must be > 0"),
            (self.eval_every >= 1, f"--eval-every {self.eval_every} must be at least 1"),
            (self.val_samples >= 1 and self.calib_samples >= 1, "--val-samples and --calib-samples must be at least 1"),
            (self.probe_variants >= 1, f"--probe-variants {self.probe_variants} must be at least 1"),
            (
                self.budgets is None or len(self.budgets) == self.clients,
                f"{len(self.budgets or ())} budgets given for {self.clients} clients; give one per client",
            ),
            (self.amp in AMP_MODES, f"--amp {self.amp!r} is unknown; choose one of {', '.join(AMP_MODES)}"),
            (not ratio_problem(self.max_weight_ratio), ratio_problem(self.max_weight_ratio)),
            (
                self.amp == "off" or self.method == "feast",
                f"--amp {self.amp} applies to --method feast only; {self.method} trains in float32",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SimulationError(message)
        try:
            check_run_options(self.payload_dtype, self.aggregation, self.trim, self.clip_norm)
            self.server_optimizer()
        except RunError as exc:
            raise SimulationError(str(exc)) from None
        if self.aggregation != "mean" and self.method != "feast":
            raise SimulationError(
                f"--aggregation {self.aggregation} applies to --method feast only; {self.method} aggregates as its paper does"
            )
        method_class(self.method).parse_options(
            dict(self.method_options)
        )  # unknown method or option: one line, before any data is read
        self._check_personalize()
        self._check_privacy()

    def dp_settings(self) -> DpSettings | None:
        """The run's validated DP settings (None: no DP)."""
        try:
            return dp_of(self)
        except PrivacyError as exc:
            raise SimulationError(str(exc)) from None

    def _check_privacy(self) -> None:
        """DP composes with the run (a sum-based aggregation, uniform weights) and its planned rounds fit --dp-epsilon."""
        dp = self.dp_settings()
        if dp is None:
            return
        if self.max_weight_ratio:
            raise SimulationError(
                "--max-weight-ratio caps sample-count weights, and under DP every update weighs 1 (a self-reported "
                "count would leak and break the noise's calibration): drop --max-weight-ratio"
            )
        try:
            check_composes(self.aggregation, method_class(self.method).private_aggregation, self.method)
            check_plan(dp, self.rounds, self.clients, self.per_round)
        except PrivacyError as exc:
            raise SimulationError(str(exc)) from None

    def _check_personalize(self) -> None:
        """--personalize and --holdout: a known choice, FEAST's served variants, and a held-out split exactly when asked."""
        try:
            choice = Choice.parse(self.personalize)
        except PersonalizeError as exc:
            raise SimulationError(str(exc)) from None
        if isinstance(self.holdout, bool) or not 0.0 <= self.holdout <= MAX_HOLDOUT:
            raise SimulationError(
                f"--holdout {self.holdout!r} must be a fraction between 0 and {MAX_HOLDOUT}, e.g. --holdout 0.1"
            )
        if self.validate_on not in VALIDATE_ON:
            raise SimulationError(
                f"--validate-on {self.validate_on!r} is unknown; choose one of {', '.join(VALIDATE_ON)}"
            )
        if self.validate_on == "devices" and (self.method != "feast" or not self.holdout):
            raise SimulationError(
                "--validate-on devices validates FEAST's variants on each client's held-out split: use --method feast "
                "and --holdout > 0 (e.g. 0.1)"
            )
        if choice.method == "off":
            if self.holdout and self.validate_on != "devices":
                raise SimulationError(
                    f"--holdout {self.holdout:g} holds out examples that only --personalize and --validate-on devices "
                    "measure on; add --personalize auto (or METHOD) or --validate-on devices, or drop --holdout"
                )
            return
        if self.method != "feast":
            raise SimulationError(
                f"--personalize {self.personalize} applies to --method feast only (its served models are the cached "
                f"variants); {self.method} serves models of its own"
            )
        if not self.holdout:
            raise SimulationError(
                f"--personalize {self.personalize} needs each client's own held-out split: give --holdout > 0 (e.g. 0.1)"
            )

    def decisive(self) -> dict[str, Any]:
        """Every setting that changes the trained weights or the selection (not the device), the resolved recipe included."""
        skip = (
            "device",
            "deterministic",
            "lr",
            "batch_size",
            "augment",
            "epochs",
            "lr_schedule",
            "recipe",
            "payload_dtype",
            *_AGGREGATION,
            *_SERVER_OPT,
        )
        skip += ("amp",) if self.amp == "off" else ()
        skip += ("max_weight_ratio",) if not self.max_weight_ratio else ()  # runs without a cap keep their fingerprints
        skip += tuple(f for f in asdict(self) if f.startswith("dp_"))  # recorded below, resolved, only when DP is on
        skip += ("personalize",)  # what happens after the last round: the weights and the selection are the same
        skip += ("holdout",) if not self.holdout else ()  # a held-out split changes the training data
        skip += ("validate_on",) if self.validate_on == "server" else ()  # earlier runs keep their fingerprints
        data = {
            k: v for k, v in asdict(self).items() if k not in skip
        }  # float32 training keeps earlier runs' fingerprints
        train, schedule = self.recipe_settings()
        return {
            **data,
            **recorded_of(self, train, schedule),
        }

    def server_optimizer(self) -> ServerOpt:
        """The validated server optimizer of ``--server-opt`` and its settings (for a method that averages)."""
        averaging = method_class(self.method).averaging
        return server_opt_of(
            self.server_opt, self.server_lr, self.server_momentum, self.server_betas, self.server_tau, averaging
        )

    def fingerprint(self) -> str:
        """Digest of :meth:`decisive`."""
        return hashlib.sha256(json.dumps(self.decisive(), sort_keys=True).encode()).hexdigest()

    def recipe_settings(self) -> tuple[TrainConfig, str]:
        """The training recipe: the preset's [train] table, then --recipe, then the explicit options (and the lr schedule)."""
        try:
            return preset_recipe(
                self.preset,
                dict(self.recipe),
                lr=self.lr,
                batch_size=self.batch_size,
                augment=self.augment,
                epochs=self.epochs,
                lr_schedule=self.lr_schedule,
                variants=self.variants,
            )
        except TrainError as exc:
            raise SimulationError(f"training recipe: {exc}") from None

    def train_config(self) -> TrainConfig:
        return self.recipe_settings()[0]


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
    holdout: float = 0.0  # each client's held-out share of its shard (config.holdout): never trains

    def _shard(self, client_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.pool[self.population.partition.shards[self.client_ids.index(client_id)]]
        index = torch.tensor(np.asarray(shard), dtype=torch.long)
        return self.train_set.images[index], self.train_set.labels[index]

    def client_data(self, client_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's training examples: its shard, less its held-out split when ``holdout`` > 0."""
        images, labels = self._shard(client_id)
        if not self.holdout:
            return images, labels
        train, _ = holdout_split(labels, self.holdout, HOLDOUT_SEED)
        return images[train], labels[train]

    def client_holdout(self, client_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The client's own held-out examples (none when ``holdout`` is 0): the device agent's split of its shard."""
        images, labels = self._shard(client_id)
        _, held = holdout_split(labels, self.holdout, HOLDOUT_SEED)
        return images[held], labels[held]

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
    split = server_split(len(train), _rng(config.seed, _SPLIT), n_val=config.val_samples, n_calib=config.calib_samples)
    pool = split.train
    if config.train_limit is not None:
        if config.train_limit < 10 * config.clients:
            raise SimulationError(
                f"--train-limit {config.train_limit} is too small for {config.clients} clients (each needs >= 10 examples)"
            )
        pool = np.sort(_rng(config.seed, _SPLIT + 100).permutation(pool)[: config.train_limit])
    labels = train.labels.numpy()[pool]
    rng = _rng(config.seed, _POPULATION)
    b_min = preset.budget_min if config.budget_min is None else config.budget_min
    b_max = preset.budget_max if config.budget_max is None else config.budget_max
    b_cap = preset.budget_cap if config.budget_cap is None else config.budget_cap
    if config.budgets is not None:
        population = build_population(
            labels, config.budgets, rng, gamma=config.gamma, alpha_eff=config.alpha_eff, b_cap=b_cap
        )
    else:
        population = zipf_population(
            labels,
            config.clients,
            rng,
            s=config.zipf_s,
            b_min=b_min,
            b_max=b_max,
            gamma=config.gamma,
            alpha_eff=config.alpha_eff,
            b_cap=b_cap,
        )
    # Zipf budgets can land anywhere from budget_min up, so the floor itself must be affordable.
    low = (
        float(np.min(population.budgets))
        if config.budgets is not None
        else min(b_min, float(np.min(population.budgets)))
    )
    if low < cache.smallest.macs:
        raise SimulationError(
            cache.below_smallest(low, f"raise the budgets (--budget-min) to at least {cache.smallest.macs}")
        )
    ids = [f"client-{i:03d}" for i in range(config.clients)]
    setup = Setup(
        preset, cache, train, test, split.validation, split.calibration, pool, population, ids, holdout=config.holdout
    )
    setup.plans = {cid: plan_client(cache, float(b)) for cid, b in zip(ids, population.budgets)}
    return setup
