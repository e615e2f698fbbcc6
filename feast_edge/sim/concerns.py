"""A simulation's own concerns beside the shared ones (feast_edge.settings): its clients and their population over
time, who validates, personalization and the held-out and test splits, and the clock of asynchronous rounds."""

from __future__ import annotations

from dataclasses import dataclass

from feast_edge.data.holdout import MAX_HOLDOUT
from feast_edge.errors import FeastError
from feast_edge.personalize.select import Choice, PersonalizeError
from feast_edge.run.clock import CLOCKS, RATE, ClockModel
from feast_edge.settings import (
    Concern,
    Population,
    SettingsError,
    Validation,
)
from feast_edge.settings.nested import check, setting
from feast_edge.settings.shared import ROUND_TIMEOUT
from feast_edge.sim.growth import over_time_checks

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
