"""The paper's research protocol in one process (SPEC §4–§8), with checkpoints and exact resume.

``Simulation(config, out_dir).run()`` builds the server-held splits, the
client population and the global supernet, then runs the federation's run
loop (``feast_edge.run.loop.RunLoop``, the one ``feast-server`` runs) with an
in-process collector: each cohort member's local co-training runs here, through
the same functions an agent runs (``feast_edge.route.plans``). The loop writes
``checkpoint.safetensors`` atomically after every round and keeps
``best.safetensors``; at the end the simulation tests every cached variant of
the best checkpoint and writes ``results.json``, ``variants.csv`` and
``rounds.csv``.

All randomness derives from ``config.seed`` and the round index, so a resumed
run ends with exactly the weights of an uninterrupted one.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feast_edge.aggregate.robust import check_rule, rule_settings
from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.data.images import FASHION_MNIST_DIR, DataError, ImageSet, load_dataset
from feast_edge.errors import FeastError
from feast_edge.local.precision import AMP_MODES, set_deterministic
from feast_edge.local.recipe import TrainConfig, TrainError, recipe_config
from feast_edge.route.payload import PAYLOAD_DTYPES
from feast_edge.route.plans import plan_client
from feast_edge.run.loop import BEST, CHECKPOINT, Collected, RoundRecord, RunError, RunLoop, RunSettings, Validation
from feast_edge.run.roundlog import ROUNDS_CSV, RoundLog, write_rounds_csv
from feast_edge.sim.methods import Method, method_class
from feast_edge.sim.population import Population, build_population, server_split, zipf_population
from feast_edge.space.preset import Preset, load_preset
from feast_edge.util.atomic import atomic_write_bytes

KIND = "simulation"
_AGGREGATION = ("aggregation", "trim", "clip_norm")
# Stream tags of the one-off random draws (rounds use feast_edge.route.plans's streams).
_SPLIT, _POPULATION = 11, 12


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
    variants: str = "full"  # FEAST's ablation switch (SPEC §7)
    # Training recipe: None takes the preset's [train] value (SPEC §7's where the preset is silent).
    lr: float | None = None
    batch_size: int | None = None
    augment: str | bool | None = None  # feast_edge.local.augment.POLICIES (True/False: SPEC §7's policy / none)
    epochs: int | None = None  # local epochs per round
    lr_schedule: str | None = None  # cosine or constant, over the federation horizon
    recipe: tuple[tuple[str, Any], ...] = ()  # further [train] keys to override (--recipe KEY=VALUE), sorted
    eval_every: int = 5
    val_samples: int = 5000
    calib_samples: int = 500
    train_limit: int | None = None  # client pool size (None: all remaining training data)
    test_limit: int | None = None
    probe_variants: int = 3  # cached variants, evenly spaced by rank, averaged for checkpoint selection
    cache: str | None = None  # cache JSON (None: the one shipped for the preset)
    aggregation: str = "mean"  # mean (SPEC §6), clip, trimmed-mean or median (feast_edge.aggregate.robust)
    trim: float = 0.1  # trimmed-mean: share of the covering values dropped at each end of a position
    clip_norm: float | None = None  # clip: L2 bound of an update (None: the cohort's median update norm)
    device: str = "cpu"
    payload_dtype: str = "float32"  # payloads as the wire carries them: routed states and updates rounded to it (the model stays float32)
    amp: str = "off"  # mixed precision of local training (feast_edge.local.precision; the CLI stores what --amp resolved to on --device)
    deterministic: bool = False  # deterministic PyTorch kernels in every process of the run (CUDA; the CPU already is)

    def __post_init__(self) -> None:
        if self.budgets is not None:
            object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        object.__setattr__(self, "method_options", tuple(sorted((str(k), str(v)) for k, v in dict(self.method_options).items())))
        object.__setattr__(self, "recipe", tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in dict(self.recipe).items())))
        checks = [
            (self.clients >= 2, f"--clients {self.clients} must be at least 2"),
            (1 <= self.per_round <= self.clients, f"--per-round {self.per_round} must be between 1 and --clients ({self.clients})"),
            (self.rounds >= 1, f"--rounds {self.rounds} must be at least 1"),
            (self.gamma >= 0, f"--gamma {self.gamma} must be >= 0 (0: data independent of budget, 1: proportional)"),
            (self.zipf_s > 0, f"--zipf-s {self.zipf_s} must be > 0"),
            (self.alpha_eff > 0, f"--alpha-eff {self.alpha_eff} must be > 0"),
            (self.eval_every >= 1, f"--eval-every {self.eval_every} must be at least 1"),
            (self.val_samples >= 1 and self.calib_samples >= 1, "--val-samples and --calib-samples must be at least 1"),
            (self.probe_variants >= 1, f"--probe-variants {self.probe_variants} must be at least 1"),
            (self.budgets is None or len(self.budgets) == self.clients, f"{len(self.budgets or ())} budgets given for {self.clients} clients; give one per client"),
            (self.payload_dtype in PAYLOAD_DTYPES, f"--payload-dtype {self.payload_dtype!r} is not supported; choose one of {', '.join(PAYLOAD_DTYPES)}"),
            (self.amp in AMP_MODES, f"--amp {self.amp!r} is unknown; choose one of {', '.join(AMP_MODES)}"),
            (self.amp == "off" or self.method == "feast", f"--amp {self.amp} applies to --method feast only; {self.method} trains in float32"),
        ]
        for ok, message in checks:
            if not ok:
                raise SimulationError(message)
        try:
            check_rule(self.aggregation, self.trim, self.clip_norm)
        except ValueError as exc:
            raise SimulationError(str(exc)) from None
        if self.aggregation != "mean" and self.method != "feast":
            raise SimulationError(f"--aggregation {self.aggregation} applies to --method feast only; {self.method} aggregates as its paper does")
        method_class(self.method).parse_options(dict(self.method_options))  # unknown method or option: one line, before any data is read

    def decisive(self) -> dict[str, Any]:
        """Every setting that changes the trained weights or the selection (not the device), the resolved recipe included."""
        skip = ("device", "deterministic", "lr", "batch_size", "augment", "epochs", "lr_schedule", "recipe", *_AGGREGATION)
        skip += (*(("payload_dtype",) if self.payload_dtype == "float32" else ()), *(("amp",) if self.amp == "off" else ()))
        data = {k: v for k, v in asdict(self).items() if k not in skip}  # float32 payloads and training keep earlier runs' fingerprints
        train, schedule = self.recipe_settings()
        return {**data, "train": asdict(train), "lr_schedule": schedule, **rule_settings(self.aggregation, self.trim, self.clip_norm)}

    def fingerprint(self) -> str:
        """Digest of :meth:`decisive`."""
        return hashlib.sha256(json.dumps(self.decisive(), sort_keys=True).encode()).hexdigest()

    def recipe_settings(self) -> tuple[TrainConfig, str]:
        """The training recipe: the preset's [train] table, then --recipe, then the explicit options (and the lr schedule)."""
        try:
            recipe = {**load_preset(self.preset).recipe, **dict(self.recipe)}
            return recipe_config(
                recipe, lr=self.lr, batch_size=self.batch_size, augment=self.augment, epochs=self.epochs, lr_schedule=self.lr_schedule, variants=self.variants
            )
        except TrainError as exc:
            raise SimulationError(f"training recipe: {exc}") from None

    def train_config(self) -> TrainConfig:
        return self.recipe_settings()[0]


@dataclass
class RoundProgress:
    """What the progress display shows after each round (``round`` is 1-based)."""

    round: int
    rounds: int
    loss: float
    val_accuracy: float | None
    best_val: float | None


def _rng(seed: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed, tag])


@dataclass
class Setup:
    """Everything built once from the config: data, population, cache, client plans."""

    preset: Preset
    cache: VariantCache
    train: ImageSet
    test: ImageSet
    validation: np.ndarray
    calibration: np.ndarray
    pool: np.ndarray
    population: Population
    client_ids: list[str]
    plans: dict[str, Any] = field(default_factory=dict)

    def client_data(self, client_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.pool[self.population.partition.shards[self.client_ids.index(client_id)]]
        index = torch.tensor(np.asarray(shard), dtype=torch.long)
        return self.train.images[index], self.train.labels[index]


def build_setup(config: SimulationConfig) -> Setup:
    """Load data, hold out server splits, draw the population and plan every client (and set the kernels' determinism)."""
    if config.deterministic:  # every process of a run builds its setup here, workers of --nproc too
        set_deterministic()
    preset = load_preset(config.preset)
    cache = load_cache(preset, config.cache)
    train = load_dataset(config.dataset, config.data_dir, "train", preset.input_size, preset.in_channels)
    test = load_dataset(config.dataset, config.data_dir, "test", preset.input_size, preset.in_channels)
    shape = tuple(train.images.shape[1:])
    if shape != (preset.in_channels, preset.input_size, preset.input_size):
        raise DataError(f"data set {config.dataset} has images {shape}, preset {preset.name} takes {(preset.in_channels, preset.input_size, preset.input_size)}; choose a matching --preset")
    if int(train.labels.max()) >= preset.classes:
        raise DataError(f"data set {config.dataset} has {int(train.labels.max()) + 1} classes, preset {preset.name} classifies {preset.classes}; choose a matching --preset")
    split = server_split(len(train), _rng(config.seed, _SPLIT), n_val=config.val_samples, n_calib=config.calib_samples)
    pool = split.train
    if config.train_limit is not None:
        if config.train_limit < 10 * config.clients:
            raise SimulationError(f"--train-limit {config.train_limit} is too small for {config.clients} clients (each needs >= 10 examples)")
        pool = np.sort(_rng(config.seed, _SPLIT + 100).permutation(pool)[: config.train_limit])
    labels = train.labels.numpy()[pool]
    rng = _rng(config.seed, _POPULATION)
    b_min = preset.budget_min if config.budget_min is None else config.budget_min
    b_max = preset.budget_max if config.budget_max is None else config.budget_max
    b_cap = preset.budget_cap if config.budget_cap is None else config.budget_cap
    if config.budgets is not None:
        population = build_population(labels, config.budgets, rng, gamma=config.gamma, alpha_eff=config.alpha_eff, b_cap=b_cap)
    else:
        population = zipf_population(labels, config.clients, rng, s=config.zipf_s, b_min=b_min, b_max=b_max, gamma=config.gamma, alpha_eff=config.alpha_eff, b_cap=b_cap)
    # Zipf budgets can land anywhere from budget_min up, so the floor itself must be affordable.
    low = float(np.min(population.budgets)) if config.budgets is not None else min(b_min, float(np.min(population.budgets)))
    if low < cache.smallest.macs:
        raise SimulationError(cache.below_smallest(low, f"raise the budgets (--budget-min) to at least {cache.smallest.macs}"))
    ids = [f"client-{i:03d}" for i in range(config.clients)]
    setup = Setup(preset, cache, train, test, split.validation, split.calibration, pool, population, ids)
    setup.plans = {cid: plan_client(cache, float(b)) for cid, b in zip(ids, population.budgets)}
    return setup


class InProcessCollector:
    """Collects a cohort's updates in this process: the method trains each member on its shard."""

    def __init__(self, setup: Setup, method: Method) -> None:
        self.setup = setup
        self.method = method
        self.budgets = {cid: float(b) for cid, b in zip(setup.client_ids, setup.population.budgets)}
        self.on_start: Callable[[int, Sequence[str], Mapping[str, Any]], None] | None = None  # told each round's (t, cohort, plans)

    def clients(self, needed: int) -> list[str]:
        return list(self.setup.client_ids)

    def budget(self, client: str) -> float:
        return self.budgets[client]

    def collect(self, t: int, cohort: Sequence[str], plans: Mapping[str, Any], global_state: Mapping[str, torch.Tensor], lr: float) -> Collected:
        if self.on_start is not None:
            self.on_start(t, cohort, plans)
        return Collected(self.method.collect(t, cohort, plans, global_state, lr))


class Simulation:
    """One simulated federation, checkpointed in ``out_dir``."""

    def __init__(self, config: SimulationConfig, out_dir: str | Path) -> None:
        self.config = config
        self.out = Path(out_dir)
        self.setup = build_setup(config)
        self.preset = self.setup.preset
        self.method = method_class(config.method)(self.setup, config)
        self.model = self.method.model
        s = self.setup
        _, schedule = config.recipe_settings()
        calibration = s.train.images[torch.tensor(np.asarray(s.calibration), dtype=torch.long)]
        val = torch.tensor(np.asarray(s.validation), dtype=torch.long)
        settings = RunSettings(
            rounds=config.rounds, per_round=config.per_round, min_clients=1, seed=config.seed, lr=config.train_config().lr, eval_every=config.eval_every,
            probe_variants=config.probe_variants, device=config.device, aggregation=config.aggregation, trim=config.trim, clip_norm=config.clip_norm,
            lr_schedule=schedule, payload_dtype=config.payload_dtype,
        )
        self.loop = RunLoop(
            self.model, s.cache, settings, self.out, kind=KIND, fingerprint=config.fingerprint(),
            config=config.decisive(),
            validation=Validation(calibration, s.train.images[val], s.train.labels[val]),
            method=self.method, model_record=None if self.method.supernet else self.method.model_record(),
        )
        self.collector = InProcessCollector(s, self.method)

    @property
    def history(self) -> list[RoundRecord]:
        return self.loop.history

    @property
    def best(self) -> dict[str, Any]:
        return self.loop.best

    def resume(self) -> int:
        """Load ``checkpoint.safetensors``; returns the number of completed rounds."""
        path = self.out / CHECKPOINT
        if not path.is_file():
            raise SimulationError(f"--resume: no checkpoint at {path}; run without --resume to start, or point --out at the run to resume")
        try:
            return self.loop.resume("rerun with the same options, or use a new --out without --resume")
        except RunError as exc:
            raise SimulationError(f"--resume: {exc}") from None

    def run_round(self, t: int) -> RoundRecord:
        """Round ``t`` alone (no checkpoint): cohort -> route -> local co-training -> sparse aggregation."""
        return self.loop.run_round(t, self.collector, 1)

    def run(
        self,
        resume: bool = False,
        on_round: Callable[[RoundProgress], None] | None = None,
        stop_after: int | None = None,
        on_test: Callable[[int, int], None] | None = None,
        on_record: Callable[[RoundRecord], None] | None = None,
        tensorboard: bool = False,
    ) -> dict[str, Any] | None:
        """Run (or resume) to the last round, then test; ``stop_after`` rounds ends early (returns None).

        After every round ``rounds.csv`` is rewritten (and TensorBoard scalars added with ``tensorboard``); ``on_record``
        gets the round's record (e.g. a dashboard).
        """
        self.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self.resume()
        rounds = self.config.rounds
        log = RoundLog(self.out, tensorboard=tensorboard, first_round=len(self.history) + 1)

        def progress(record: RoundRecord) -> None:
            log.write(self.history)
            if on_record is not None:
                on_record(record)
            if on_round is not None:
                on_round(RoundProgress(record.round, rounds, record.loss or 0.0, record.val_accuracy, self.best.get("val_accuracy")))

        try:
            self.loop.run(self.collector, on_round=progress, stop_after=stop_after)
        finally:
            log.close()
        if not self.loop.finished:
            return None
        return self.finish(on_test)

    # ----------------------------------------------------------------- results
    def finish(self, on_test: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Test every cached variant of the best checkpoint; write results.json, variants.csv, rounds.csv."""
        s, cfg = self.setup, self.config
        best_path = self.out / BEST
        if best_path.is_file():
            model = self.loop.load(best_path)[0]
            if model is not self.model:
                self.model.load_state_dict(model.state_dict())
        test_images, test_labels = s.test.images, s.test.labels
        if cfg.test_limit is not None:
            test_images, test_labels = test_images[: cfg.test_limit], test_labels[: cfg.test_limit]
        calib = s.train.images[torch.tensor(np.asarray(s.calibration), dtype=torch.long)]
        points = self.method.points()
        accs = self.method.evaluate(points, calib, test_images, test_labels, cfg.device, on_test)
        budgets = [float(b) for b in s.population.budgets]
        served = [self.method.served(b) for b in budgets]
        variants = []
        for i, (p, a) in enumerate(zip(points, accs)):
            variants.append({"index": i, **p.to_dict(), "test_accuracy": a, **({"arch": dict(p.detail)} if {"d", "e", "w"} <= set(p.detail) else {})})
        results = {
            "method": cfg.method,
            "method_summary": self.method.summary,
            "config": {**asdict(cfg), "train": asdict(cfg.train_config()), "lr_schedule": cfg.recipe_settings()[1]},
            "preset": self.preset.name,
            "best": self.best,
            "population": population_summary(s.population),
            "population_accuracy": sum(accs[i] for i in served) / len(served),
            "variants": variants,
            "served": served,
            "communication": communication_summary(self.history),
            "compute": {"train_macs_total": sum(h.train_macs for h in self.history)},
            "rounds": [asdict(h) for h in self.history],
            "seconds_total": sum(h.seconds for h in self.history),
        }
        atomic_write_bytes(self.out / "results.json", json.dumps(results, indent=2).encode())
        _write_csv(
            self.out / "variants.csv", ["index", "label", "macs", "params", "test_accuracy", "detail"],
            [[v["index"], v["label"], v["macs"], v["params"], f"{v['test_accuracy']:.4f}", json.dumps(v["detail"])] for v in results["variants"]],
        )
        write_rounds_csv(self.out / ROUNDS_CSV, self.history)
        return results


def population_summary(population: Population) -> dict[str, Any]:
    """α_eff, shard sizes, budgets and per-class counts of a population (SPEC §4)."""
    sizes = population.sizes
    return {
        "clients": population.n_clients,
        "gamma": population.gamma,
        "alpha_eff": population.alpha_eff,
        "shard_size_min": int(sizes.min()),
        "shard_size_max": int(sizes.max()),
        "budgets": [float(b) for b in population.budgets],
        "shard_sizes": [int(n) for n in sizes],
        "class_counts": population.partition.class_counts.tolist(),
    }


def communication_summary(history: list[RoundRecord]) -> dict[str, Any]:
    """Routed vs full-supernet traffic over the rounds run (both directions), in parameters and in bytes (payload dtype
    against a float32 broadcast)."""
    routed = 2 * sum(h.routed_params for h in history)
    full = 2 * sum(h.full_params for h in history)
    routed_bytes = 2 * sum(h.routed_bytes for h in history)
    full_bytes = 2 * sum(h.full_bytes for h in history)
    return {
        "routed_params_total": routed, "full_params_total": full, "reduction": full / routed if routed else None,
        "routed_bytes_total": routed_bytes, "full_bytes_total": full_bytes, "bytes_reduction": full_bytes / routed_bytes if routed_bytes else None,
    }


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write_bytes(path, buffer.getvalue().encode())
