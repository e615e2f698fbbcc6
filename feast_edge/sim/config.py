"""What decides a simulation's result: its settings by concern (feast_edge.settings) and the checks across them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.local.precision import AMP_MODES
from feast_edge.local.recipe import TrainConfig
from feast_edge.personalize.select import Choice
from feast_edge.privacy.private_rounds import check_plan
from feast_edge.privacy.settings import DpSettings, PrivacyError, check_composes
from feast_edge.settings import (
    Aggregation,
    Concern,
    Privacy,
    Schedule,
    SettingsError,
    Training,
    flat,
)
from feast_edge.settings.concerns import (
    SecureAggregation,
    async_refusals,
    continuous_refusals,
    secure_refusals,
    server_step,
)
from feast_edge.settings.nested import changed, flat_types, key_of, of, setting
from feast_edge.settings.shared import CACHE, PRESET, SEED
from feast_edge.settings.versions import ModelVersions
from feast_edge.sim.concerns import (
    OVER_TIME,
    ClientPopulation,
    ClientValidation,
    Personalization,
    SimulationError,
    Timing,
)
from feast_edge.sim.growth import over_time_refusals
from feast_edge.sim.registry import method_class


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that decides a simulation's result (``device`` aside), by concern. ``SimulationConfig.of(...)``
    takes the settings flat, by their keys (``per_round=3, dp_clip=1.0``), as the command line and stored runs give
    them."""

    preset: str = setting("fmnist-small", help=PRESET)
    dataset: str = setting(
        "fashion-mnist",
        help="fashion-mnist, cifar10, cifar100 (binary release) or imagefolder (--data/train/<class name>/*, "
        "--data/test/<class name>/*, labelled by the preset's class names).",
    )
    data_dir: str = setting(str(FASHION_MNIST_DIR), help="Local data directory (never downloaded).")  # --data
    seed: int = setting(0, help=SEED)
    method: str = "feast"  # feast_edge.sim.methods.METHODS
    method_options: tuple[tuple[str, str], ...] = ()  # --method-option KEY=VALUE pairs, sorted by key
    test_limit: int | None = setting(None, help="Test on only the first N test examples.")
    cache: str | None = setting(None, help=CACHE)
    device: str = "cpu"
    amp: str = "off"  # mixed precision of local training (feast_edge.local.precision; as --amp resolved on --device)
    deterministic: bool = False  # deterministic PyTorch kernels in every process of the run (CUDA; the CPU already is)
    population: ClientPopulation = field(default_factory=ClientPopulation)
    training: Training = field(default_factory=lambda: Training(rounds=30))
    aggregation: Aggregation = field(default_factory=Aggregation)
    privacy: Privacy = field(default_factory=Privacy)
    validation: ClientValidation = field(default_factory=ClientValidation)
    serving: Personalization = field(default_factory=Personalization)
    schedule: Schedule = field(default_factory=Schedule)
    timing: Timing = field(default_factory=Timing)
    secure: SecureAggregation = field(default_factory=SecureAggregation)
    versions: ModelVersions = field(default_factory=ModelVersions)

    @classmethod
    def of(cls, **settings: Any) -> SimulationConfig:
        """The configuration with ``settings`` (by key) changed from the defaults; a SimulationError naming a bad one."""
        try:
            return of(cls, **settings)
        except SettingsError as exc:
            raise SimulationError(str(exc)) from None

    @classmethod
    def recorded(cls, config: dict[str, Any], **changes: Any) -> SimulationConfig:
        """The configuration a run recorded (results.json's ``config``: its settings by key, and what the run resolved
        beside them), with ``changes``."""
        known = flat_types(cls)
        return cls.of(**{**{k: v for k, v in config.items() if k in known}, **changes})

    def changed(self, **settings: Any) -> SimulationConfig:
        """This configuration with ``settings`` (by key) changed."""
        try:
            return changed(self, **settings)
        except SettingsError as exc:
            raise SimulationError(str(exc)) from None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "method_options", tuple(sorted((str(k), str(v)) for k, v in dict(self.method_options).items()))
        )
        checks = [
            (self.amp in AMP_MODES, f"--amp {self.amp!r} is unknown; choose one of {', '.join(AMP_MODES)}"),
            (
                self.amp == "off" or self.method == "feast",
                f"--amp {self.amp} applies to --method feast only; {self.method} trains in float32",
            ),
            (
                self.aggregation.rule == "mean" or self.method == "feast",
                f"--aggregation {self.aggregation.rule} applies to --method feast only; {self.method} aggregates as "
                "its paper does",
            ),
            *over_time_refusals(self),
        ]
        for ok, message in checks:
            if not ok:
                raise SimulationError(message)
        try:
            self.server_optimizer()
        except SettingsError as exc:
            raise SimulationError(str(exc)) from None
        method_class(self.method).parse_options(
            dict(self.method_options)
        )  # unknown method or option: one line, before any data is read
        self._check_personalize()
        self._check_privacy()
        self._check_schedule()
        self._check_secure()
        refusals = [
            *continuous_refusals(self),
            (not (self.training.continuous and self.timing.compute_budget), "--continuous with --compute-budget: "
             "the budget is a horizon; drop one of them"),
            (not self.versions.versions or self.validation.validate_on == "devices", "--versions: each device gates "
             "a version on its own held-out split; add --validate-on devices (and --holdout)"),
            (not self.versions.versions or self.schedule.mode == "sync", "--versions follows the served round of "
             "synchronous rounds; drop --mode async"),
            (self.population.drift_clients <= self.population.clients, (f"--drift-clients "
             f"{self.population.drift_clients} is more than --clients {self.population.clients}")),
            (self.validation.lying_validators < self.population.clients, (f"--lying-validators "
             f"{self.validation.lying_validators} must leave an honest client of --clients "
             f"{self.population.clients}")),
        ]  # fmt: skip
        for ok, message in refusals:
            if not ok:
                raise SimulationError(message)

    def _check_schedule(self) -> None:
        """Buffered asynchronous rounds train FEAST from as many clients as they draw; central DP weighs the buffered
        updates alike."""
        if self.schedule.mode != "async":
            return
        pop, rules = self.population, self.schedule
        checks = [
            (
                self.method == "feast",
                f"--mode async trains FEAST's routed slices; {self.method} runs synchronous rounds",
            ),
            *async_refusals(self),
            (
                rules.concurrency <= pop.clients,
                f"--concurrency {rules.concurrency} is more than --clients {pop.clients}: each slot trains one client",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SimulationError(message)

    def _check_secure(self) -> None:
        """Secure sums release method §6 from per-segment sums: what needs each client's update is refused."""
        if not self.secure.secure_agg:
            return
        checks = [
            (self.method == "feast", f"--secure-agg sums FEAST's routed segments; {self.method} is not offered"),
            *secure_refusals(self, "client"),
            (not self.aggregation.max_weight_ratio, "--secure-agg with --max-weight-ratio: the cap needs each "
             "client's count beside its update; registered counts are capped before masking instead"),
            (self.population.per_round >= self.secure.colluders + 2, (f"--secure-agg with --per-round "
             f"{self.population.per_round}: a segment is revealed only over --colluders + 2 = "
             f"{self.secure.colluders + 2} clients; sample at least that many")),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise SimulationError(message)

    def dp_settings(self) -> DpSettings | None:
        """The run's validated DP settings (None: no DP)."""
        return self.privacy.settings()

    def _check_privacy(self) -> None:
        """DP composes with the run (a sum-based aggregation, uniform weights) and its planned rounds fit --dp-epsilon."""
        dp = self.dp_settings()
        if dp is None:
            return
        if self.aggregation.max_weight_ratio:
            raise SimulationError(
                "--max-weight-ratio caps sample-count weights, and under DP every update weighs 1 (a self-reported "
                "count would leak and break the noise's calibration): drop --max-weight-ratio"
            )
        try:
            check_composes(self.aggregation.rule, method_class(self.method).private_aggregation, self.method)
            check_plan(dp, *self._accounted_plan())
        except PrivacyError as exc:
            raise SimulationError(str(exc)) from None

    def _accounted_plan(self) -> tuple[int, int, int, bool]:
        """What --dp-epsilon checks before the run: its rounds (releases), the population, the cohort (the buffer)
        and whether cohorts are sampled (asynchronous releases are not)."""
        if self.schedule.mode == "async":
            return self.training.rounds, self.population.clients, self.schedule.buffer, False
        return self.training.rounds, self.population.clients, self.population.per_round, True

    def _check_personalize(self) -> None:
        """--personalize and --holdout: FEAST's served variants, and a held-out split exactly when asked."""
        serving, validate_on = self.serving, self.validation.validate_on
        if validate_on == "devices" and (self.method != "feast" or not serving.holdout):
            raise SimulationError(
                "--validate-on devices validates FEAST's variants on each client's held-out split: use --method feast "
                "and --holdout > 0 (e.g. 0.1)"
            )
        if Choice.parse(serving.personalize).method == "off":
            if serving.holdout and validate_on != "devices":
                raise SimulationError(
                    f"--holdout {serving.holdout:g} holds out examples that only --personalize and --validate-on "
                    "devices measure on; add --personalize auto (or METHOD) or --validate-on devices, or drop --holdout"
                )
            return
        if self.method != "feast":
            raise SimulationError(
                f"--personalize {serving.personalize} applies to --method feast only (its served models are the "
                f"cached variants); {self.method} serves models of its own"
            )
        if not serving.holdout:
            raise SimulationError(
                f"--personalize {serving.personalize} needs each client's own held-out split: give --holdout > 0 "
                "(e.g. 0.1)"
            )

    def decisive(self) -> dict[str, Any]:
        """Every setting that changes the trained weights or the selection (not the device), the resolved recipe
        included: the keys runs have always recorded, so earlier runs keep their fingerprints."""
        values = flat(self)
        recipe = ("lr", "batch_size", "augment", "epochs", "lr_schedule", "recipe")
        skip = {"device", "deterministic", *recipe, *_fields_of(self.aggregation), *_fields_of(self.privacy)}
        skip |= {"amp"} if self.amp == "off" else set()
        skip |= {"personalize"}  # what happens after the last round: the weights and the selection are the same
        # Without a horizon, --rounds is only where an invocation stops (a run may be extended: feast_edge.run.store).
        skip |= {"rounds"} if self.training.continuous else {"continuous", "lr_period"}
        skip |= {"holdout"} if not self.serving.holdout else set()  # a held-out split changes the training data
        skip |= {"validate_on"} if self.validation.validate_on == "server" else set()
        skip |= {"serve_average"} if self.validation.serve_average is None else set()  # recorded where set
        skip |= set(_fields_of(self.schedule)) if self.schedule.mode == "sync" else set()  # recorded where async
        skip |= set(_fields_of(self.secure)) if not self.secure.secure_agg else set()  # recorded where on
        skip |= set(_fields_of(self.timing)) if self.schedule.mode == "sync" and not self.timing.decides else set()
        skip |= set() if self.population.over_time else set(OVER_TIME)  # recorded where clients join or shards grow
        skip |= {"drift_clients"} if not self.population.drift_clients else set()  # recorded where some drift
        skip |= {"test_split"} if not self.serving.test_split else set()  # a test split changes the training data
        skip |= {"lying_validators"} if not self.validation.lying_validators else set()  # it changes the served round
        skip |= set(_fields_of(self.versions))  # which versions devices install: never the weights or the selection
        capped = {"max_weight_ratio": values["max_weight_ratio"]} if values["max_weight_ratio"] else {}
        train, schedule = self.recipe_settings()
        recorded = self.aggregation.recorded(train, schedule, self.dp_settings(), method_class(self.method).averaging)
        return {**{k: v for k, v in values.items() if k not in skip}, **capped, **recorded}

    def server_optimizer(self) -> ServerOpt:
        """The validated server optimizer of ``--server-opt`` and its settings (for a method that averages)."""
        return server_step(self, method_class(self.method).averaging)

    def fingerprint(self) -> str:
        """Digest of :meth:`decisive`."""
        return fingerprint_of(self.decisive())

    def recipe_settings(self) -> tuple[TrainConfig, str]:
        """The training recipe: the preset's [train] table, then --recipe, then the explicit options (and the lr
        schedule)."""
        try:
            return self.training.recipe_of(self.preset)
        except SettingsError as exc:
            raise SimulationError(str(exc)) from None

    def train_config(self) -> TrainConfig:
        return self.recipe_settings()[0]


def fingerprint_of(decisive: Mapping[str, Any]) -> str:
    """A simulation's fingerprint: the digest of its decisive settings."""
    return hashlib.sha256(json.dumps(dict(decisive), sort_keys=True).encode()).hexdigest()


def _fields_of(concern: Concern) -> set[str]:
    """The keys of one concern's settings."""
    return {key_of(f) for f in dataclasses.fields(concern)}
