"""What a run's loop reads (feast_edge.run): the configuration's concerns as they are, and the few facts an app
resolves beside them. A setting added to a concern reaches the loop with its concern; nothing here changes.

    RunConcerns.of(config, min_clients=...)       a SimulationConfig's or ServerConfig's concerns, built once per run
    RunConcerns.of_keys(rounds=3, per_round=2)    default concerns with these keys changed (tests, benchmarks)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.privacy.settings import DpSettings
from feast_edge.settings.concerns import (
    Aggregation,
    Population,
    Privacy,
    Schedule,
    SecureAggregation,
    Training,
    Validation,
    server_step,
)
from feast_edge.settings.nested import of


@dataclass(frozen=True)
class RunConcerns:
    """A run's concerns (population, training, aggregation, privacy, validation, schedule, secure) as its
    configuration holds them, and what its app resolves beside them."""

    population: Population
    training: Training
    aggregation: Aggregation
    privacy: Privacy
    validation: Validation
    schedule: Schedule
    secure: SecureAggregation
    seed: int
    lr: float  # the recipe's learning rate (the preset's [train] lr, then --lr)
    lr_schedule: str  # the recipe's: feast_edge.local.recipe.SCHEDULES, over the federation horizon
    server_opt: ServerOpt  # the server's step, as the schedule takes it (feast_edge.settings.concerns.server_step)
    min_clients: int  # devices needed online to start a round, and valid updates needed to change the model
    device: str = "cpu"
    dp_on_devices: bool = False  # local DP applied by real devices (a server): their updates arrive noised
    compute_budget: float = 0.0  # end the run once the released updates' training MACs reach this (0: no budget)
    dp: DpSettings | None = field(init=False, repr=False, compare=False)  # the privacy concern's, resolved once

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp", self.privacy.settings())

    @classmethod
    def of(
        cls,
        config: Any,
        *,
        min_clients: int,
        device: str = "cpu",
        averaging: bool = True,
        dp_on_devices: bool = False,
        compute_budget: float = 0.0,
    ) -> RunConcerns:
        """What the round loop reads of ``config`` (a ``SimulationConfig`` or ``ServerConfig``): its concerns, its
        seed, its recipe's lr and schedule and its server step (``averaging``: the method's aggregation is an
        average); a SettingsError where they do not fit."""
        train, schedule = config.training.recipe_of(config.preset)
        return cls(
            **_concerns_of(config),
            seed=config.seed,
            lr=train.lr,
            lr_schedule=schedule,
            server_opt=server_step(config, averaging),
            min_clients=min_clients,
            device=device,
            dp_on_devices=dp_on_devices,
            compute_budget=compute_budget,
        )

    @classmethod
    def of_keys(
        cls,
        *,
        seed: int = 0,
        lr: float = 0.1,
        min_clients: int = 1,
        device: str = "cpu",
        dp_on_devices: bool = False,
        compute_budget: float = 0.0,
        **keys: Any,
    ) -> RunConcerns:
        """The default concerns with the settings ``keys`` (by key: ``rounds=3, per_round=2, dp_clip=1.0``) changed,
        ``lr`` the recipe's (without a preset); a SettingsError naming a setting that does not fit."""
        concerns = of(_Concerns, lr=lr, **keys)
        return cls(
            **_concerns_of(concerns),
            seed=seed,
            lr=lr,
            lr_schedule=concerns.training.lr_schedule or "cosine",
            server_opt=server_step(concerns),
            min_clients=min_clients,
            device=device,
            dp_on_devices=dp_on_devices,
            compute_budget=compute_budget,
        )

    def weight_cap(self) -> float:
        """The cap on self-reported weights the loop applies (0: none). Secure sums weigh each device by its capped
        registered count before masking (feast_edge.server.secure): the loop's own cap, which needs each update, is
        then not run."""
        return 0.0 if self.secure.secure_agg else self.aggregation.max_weight_ratio

    def reveal_over(self) -> int:
        """Under secure sums, the fewest devices a segment's sum is revealed over, c + 2 (feast_edge.run.stratified);
        0: plain sums."""
        return self.secure.colluders + 2 if self.secure.secure_agg else 0


@dataclass(frozen=True)
class _Concerns:
    """Every concern of a run, each by default (what :meth:`RunConcerns.of_keys` changes by key)."""

    population: Population = field(default_factory=Population)
    training: Training = field(default_factory=Training)
    aggregation: Aggregation = field(default_factory=Aggregation)
    privacy: Privacy = field(default_factory=Privacy)
    validation: Validation = field(default_factory=Validation)
    schedule: Schedule = field(default_factory=Schedule)
    secure: SecureAggregation = field(default_factory=SecureAggregation)


CONCERNS = tuple(f.name for f in fields(_Concerns))  # the concerns a run's loop reads


def _concerns_of(config: Any) -> dict[str, Any]:
    """``config``'s concern objects that a run's loop reads, by name, as they are."""
    return {name: getattr(config, name) for name in CONCERNS}
