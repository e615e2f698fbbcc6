"""What decides a simulation's result: its settings by concern (feast_edge.settings) and the checks across them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.data.holdout import MAX_HOLDOUT
from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.errors import FeastError
from feast_edge.local.precision import AMP_MODES
from feast_edge.local.recipe import TrainConfig
from feast_edge.personalize.select import Choice, PersonalizeError
from feast_edge.privacy.private_rounds import check_plan
from feast_edge.privacy.settings import DpSettings, PrivacyError, check_composes
from feast_edge.run.clock import CLOCKS, RATE, ClockModel
from feast_edge.settings import (
    Aggregation,
    Concern,
    Population,
    Privacy,
    Schedule,
    SettingsError,
    Training,
    Validation,
    flat,
)
from feast_edge.settings.concerns import (
    SecureAggregation,
    async_refusals,
    continuous_refusals,
    secure_refusals,
    server_step,
)
from feast_edge.settings.nested import changed, check, flat_types, key_of, of, setting
from feast_edge.settings.shared import CACHE, PRESET, ROUND_TIMEOUT, SEED
from feast_edge.settings.versions import ModelVersions
from feast_edge.sim.growth import over_time_checks, over_time_refusals
from feast_edge.sim.registry import method_class

VALIDATE_ON = ("server", "devices")  # --validate-on
OVER_TIME = ("joined_at_start", "join_rounds", "shard_start", "shard_growth")  # feast_edge.sim.growth's settings
DEFAULT_HOLDOUT = 0.1  # --holdout with --personalize: the device agent's share of its own data


class SimulationError(FeastError, ValueError):
    """A simulation cannot start or resume with the given settings."""


@dataclass(frozen=True)
class ClientPopulation(Population):
    """The simulated clients: how many, their MAC budgets (Zipf, method §4.1, or given) and their data (method §4.2)."""

    clients: int = setting(20, help="Number of clients N.")
    gamma: float = setting(1.0, help="Allocation exponent γ (0: data independent of budget, 1: proportional).")
    zipf_s: float = setting(1.2, help="Zipf exponent of the budget ranks.")
    alpha_eff: float = setting(0.45, help="Effective Dirichlet concentration α_eff.")
    budget_min: float | None = setting(None, help="Smallest Zipf budget (MACs, e.g. 1.5M); default from the preset.")
    budget_max: float | None = setting(None, help="Largest Zipf budget (MACs); default from the preset.")
    budget_cap: float | None = setting(None, help="Allocation cap B_cap (MACs); default from the preset.")
    budgets: tuple[float, ...] | None = None  # explicit budgets instead of Zipf (--budgets or --profiles)
    train_limit: int | None = setting(None, help="Use only this many training examples for clients.")
    # the population over time (feast_edge.sim.growth): at the defaults every client trains its whole shard from round 1
    joined_at_start: float = setting(
        1.0, min=0.0, max=1.0, help="Share of the clients present from round 1 (seeded); the others join later."
    )
    join_rounds: int = setting(
        0, min=0, help="The clients absent at round 1 join evenly over this many rounds, in a seeded order."
    )
    shard_start: float = setting(
        1.0, min=0.0, max=1.0, help="Share of its training examples a client holds when it joins (seeded which)."
    )
    shard_growth: float = setting(
        0.0, min=0.0, help="Share of its training examples a client gains each round after it joins, up to all."
    )
    drift_clients: int = setting(
        0,
        min=0,
        help="Clients (seeded) whose class mix drifts: the examples their shards grow by come class after class, in a "
        "seeded order of the classes, and their held-out and test examples are those of the classes they hold so far "
        "(needs --shard-start below 1).",
    )

    def __post_init__(self) -> None:
        if self.budgets is not None:
            object.__setattr__(self, "budgets", tuple(float(b) for b in self.budgets))
        checks = [
            (self.clients >= 2, f"--clients {self.clients} must be at least 2"),
            (
                1 <= self.per_round <= self.clients,
                f"--per-round {self.per_round} must be between 1 and --clients ({self.clients})",
            ),
            (self.gamma >= 0, f"--gamma {self.gamma} must be >= 0 (0: data independent of budget, 1: proportional)"),
            (self.zipf_s > 0, f"--zipf-s {self.zipf_s} must be > 0"),
            (self.alpha_eff > 0, f"--alpha-eff {self.alpha_eff} must be > 0"),
            (
                self.budgets is None or len(self.budgets) == self.clients,
                f"{len(self.budgets or ())} budgets given for {self.clients} clients; give one per client",
            ),
            *over_time_checks(self),
        ]
        check(checks)

    @property
    def over_time(self) -> bool:
        """Whether clients join over time or see part of their shards (feast_edge.sim.growth)."""
        return self.joined_at_start < 1 or self.shard_start < 1


@dataclass(frozen=True)
class ClientValidation(Validation):
    """Who validates (checkpoint selection): the server's held split, or the cohort's held-out splits (a server
    without data: the served-round rule, feast_edge.evaluate.served_round), some of which may lie."""

    validate_on: str = setting(
        "server",
        help="server: validate on the server's held split (the best round is served); devices: each cohort client "
        "tests the model on its own held-out split, as devices do for a server without data, and the served round "
        "is the newest without a regression on their served variants (needs --holdout).",
    )
    lying_validators: int = setting(
        0,
        min=0,
        help="With --validate-on devices: clients (seeded) whose reported held-out figures are false: 100 % at their "
        "first validation, 0 % after, and every new version a regression when they are its canaries "
        "(feast_edge.sim.device_validation).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.validate_on not in VALIDATE_ON:
            raise SettingsError(
                f"--validate-on {self.validate_on!r} is unknown; choose one of {', '.join(VALIDATE_ON)}"
            )
        if self.lying_validators and self.validate_on != "devices":
            raise SettingsError(
                f"--lying-validators {self.lying_validators}: only devices report validation figures; add "
                "--validate-on devices"
            )


@dataclass(frozen=True)
class Personalization(Concern):
    """What each client is served after the last round (feast_edge.personalize), and its held-out split."""

    # auto, off, METHOD or METHOD:STRENGTH
    personalize: str = "off"
    holdout: float = 0.0  # each client's held-out share of its shard (never trains), which personalize measures on
    test_split: float = setting(
        0.0,
        min=0.0,
        max=MAX_HOLDOUT,
        help="Each client's share of its shard set apart per class before its held-out split: never trained on, "
        "never validated or gated on; only the installed models are measured on it (--versions).",
    )

    def __post_init__(self) -> None:
        try:
            Choice.parse(self.personalize)
        except PersonalizeError as exc:
            raise SettingsError(str(exc)) from None
        if isinstance(self.holdout, bool) or not 0.0 <= self.holdout <= MAX_HOLDOUT:
            raise SettingsError(
                f"--holdout {self.holdout!r} must be a fraction between 0 and {MAX_HOLDOUT}, e.g. --holdout 0.1"
            )
        if isinstance(self.test_split, bool) or not 0.0 <= self.test_split <= MAX_HOLDOUT - self.holdout:
            raise SettingsError(
                f"--test-split {self.test_split!r} must be a fraction between 0 and {MAX_HOLDOUT} less --holdout "
                f"({self.holdout:g}), e.g. --test-split 0.1"
            )


@dataclass(frozen=True)
class Timing(Concern):
    """The virtual clock the clients' jobs run on (feast_edge.run.clock) and a synchronous round's deadline on it."""

    clock: str = setting(
        "tiers",
        help="tiers: each job's virtual time from its reported training MACs over a throughput proportional to the "
        "client's budget, plus its payloads over --link-mbps; uniform: every job takes 1 s.",
    )
    clock_rate: float = setting(RATE, help="Training MAC/s of the strongest client on the virtual clock.")
    link_mbps: float = setting(20.0, help="Every client's link on the virtual clock, Mbit/s both ways.")
    stragglers: float = setting(0.0, help="Share of the clients (seeded) that are --straggler-factor times slower.")
    straggler_factor: float = setting(10.0, help="How many times slower a straggler is.")
    jitter: float = setting(0.0, help="Sigma of each job's log-normal slowdown on the virtual clock (0: none).")
    dropout: float = setting(
        0.0, help="Probability that a job is lost (the device slept or lost its link), after its whole time."
    )
    round_timeout: float = setting(0.0, help=ROUND_TIMEOUT)
    compute_budget: float = setting(
        0.0,
        help="End the run once its released updates' training MACs reach this, e.g. 5e13 (0: --rounds only); "
        "compares synchronous and asynchronous rounds at equal client compute.",
    )

    def __post_init__(self) -> None:
        check(
            [
                (self.clock in CLOCKS, f"--clock {self.clock!r} is unknown; choose one of {', '.join(CLOCKS)}"),
                (self.clock_rate > 0 and self.link_mbps > 0, "--clock-rate and --link-mbps must be > 0"),
                (0 <= self.stragglers <= 1, f"--stragglers {self.stragglers} must be a share between 0 and 1"),
                (self.straggler_factor >= 1, f"--straggler-factor {self.straggler_factor} must be at least 1"),
                (self.jitter >= 0, f"--jitter {self.jitter} must be >= 0"),
                (0 <= self.dropout < 1, f"--dropout {self.dropout} must be in [0, 1)"),
                (self.round_timeout >= 0, f"--round-timeout {self.round_timeout} must be >= 0 (0: no deadline)"),
                (self.compute_budget >= 0, f"--compute-budget {self.compute_budget} must be >= 0 (0: no budget)"),
            ]
        )

    def model(self) -> ClockModel:
        return ClockModel(
            self.clock,
            self.clock_rate,
            self.link_mbps,
            self.stragglers,
            self.straggler_factor,
            self.jitter,
            self.dropout,
        )

    @property
    def decides(self) -> bool:
        """Whether the clock changes the trained weights of synchronous rounds (a deadline or lost jobs)."""
        return self.round_timeout > 0 or self.dropout > 0 or self.compute_budget > 0


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
