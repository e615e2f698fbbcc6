"""The concerns both a simulation and a federation server are configured by: how devices train, how their updates
become the model, the privacy of those updates, and how rounds are validated (each app adds its own to them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.aggregate.weights import ratio_problem
from feast_edge.local.recipe import TrainConfig, TrainError, preset_recipe
from feast_edge.privacy.settings import DpSettings, PrivacyError, dp_of
from feast_edge.secagg.fixed import DEFAULT_BOUND
from feast_edge.settings.buffered import SERVER_LR, AsyncSettings
from feast_edge.settings.nested import Concern, SettingsError, check, setting
from feast_edge.settings.validated import RunError, check_run_options, recorded_settings, server_opt_of


@dataclass(frozen=True)
class Population(Concern):
    """Who trains in a round: the cohort's size (the app adds where its devices come from)."""

    per_round: int = 5  # devices (clients) sampled per round

    def __post_init__(self) -> None:
        check([(self.per_round >= 1, f"--per-round {self.per_round} must be at least 1")])


@dataclass(frozen=True)
class Training(Concern):
    """How each device trains: the rounds' horizon and the local recipe (None: the preset's [train] value)."""

    rounds: int = 10  # federation rounds (also the cosine-decay horizon)
    lr: float | None = None
    batch_size: int | None = None
    variants: str = "full"  # FEAST's variants per batch (method §7 ablations)
    augment: str | bool | None = None  # feast_edge.local.augment.POLICIES (True/False: method §7's policy / none)
    epochs: int | None = None  # local epochs per round (--local-epochs)
    lr_schedule: str | None = None  # cosine or constant, over the federation horizon
    recipe: tuple[tuple[str, Any], ...] = ()  # further [train] keys to override (--recipe KEY=VALUE), sorted

    def __post_init__(self) -> None:
        recipe = tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in dict(self.recipe).items()))
        object.__setattr__(self, "recipe", recipe)
        check([(self.rounds >= 1, f"--rounds {self.rounds} must be at least 1")])

    def recipe_of(self, preset: str) -> tuple[TrainConfig, str]:
        """The training recipe: ``preset``'s [train] table, then --recipe, then the explicit options (and the lr
        schedule)."""
        try:
            return preset_recipe(
                preset,
                dict(self.recipe),
                lr=self.lr,
                batch_size=self.batch_size,
                augment=self.augment,
                epochs=self.epochs,
                lr_schedule=self.lr_schedule,
                variants=self.variants,
            )
        except TrainError as exc:
            raise SettingsError(f"training recipe: {exc}") from None


@dataclass(frozen=True)
class Aggregation(Concern):
    """How a round's updates become the next model: the rule over the clients covering each position (method §6 or a
    robust one), the weights' cap, the wire's dtype and the server's step."""

    rule: str = setting("mean", key="aggregation")  # mean (method §6), clip, trimmed-mean or median
    trim: float = 0.1  # trimmed-mean: share of the covering values dropped at each end of a position
    clip_norm: float | None = None  # clip: L2 bound of an update (None: the cohort's median update norm)
    # A self-reported sample count weighs at most this many times the round's lower-median count (0: no cap;
    # feast_edge.aggregate.weights).
    max_weight_ratio: float = 0.0
    payload_dtype: str = "float32"  # routed states and updates on the wire are rounded to it (the model stays float32)
    # The server's step from each round's aggregate (feast_edge.aggregate.server_opt); avg with lr 1 is method §6's.
    server_opt: str = "avg"
    server_lr: float | None = None  # None: the rule's default (feast_edge.aggregate.server_opt.DEFAULT_LR)
    server_momentum: float = 0.9
    server_betas: tuple[float, ...] = (0.9, 0.99)
    server_tau: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_betas", tuple(float(b) for b in self.server_betas))
        check([(not ratio_problem(self.max_weight_ratio), ratio_problem(self.max_weight_ratio))])
        try:
            check_run_options(self.payload_dtype, self.rule, self.trim, self.clip_norm)
            self.optimizer()
        except RunError as exc:
            raise SettingsError(str(exc)) from None

    def optimizer(self, averaging: bool = True) -> ServerOpt:
        """The validated server optimizer of ``--server-opt`` and its settings (``averaging``: the method's
        aggregation is an average, which a step other than plain averaging needs)."""
        try:
            return server_opt_of(
                self.server_opt, self.server_lr, self.server_momentum, self.server_betas, self.server_tau, averaging
            )
        except RunError as exc:
            raise SettingsError(str(exc)) from None

    def recorded(
        self, train: TrainConfig, schedule: str, dp: DpSettings | None, averaging: bool = True
    ) -> dict[str, Any]:
        """What the run's fingerprint records of its recipe, aggregation, wire and privacy
        (feast_edge.settings.validated.recorded_settings)."""
        opt = self.optimizer(averaging)
        return recorded_settings(train, schedule, self.rule, self.trim, self.clip_norm, self.payload_dtype, opt, dp)


@dataclass(frozen=True)
class Privacy(Concern):
    """Client-level differential privacy (feast_edge.privacy, docs/privacy.md): dp_clip and dp_noise together, or
    neither."""

    dp_clip: float | None = None
    dp_noise: float | None = None
    dp_delta: float | None = None  # None: 1e-5 or 0.1/population, whichever is smaller
    dp_epsilon: float | None = None  # the privacy budget; None: no limit
    dp_seed: int | None = None  # None: noise from the OS (not reproducible)
    dp_mode: str = "central"
    dp_clip_quantile: float | None = None  # adaptive clipping toward this quantile of the update norms; None: fixed
    dp_clip_lr: float = 0.2
    dp_clip_count_std: float | None = None  # None: a tenth of the privacy on the unclipped count

    def __post_init__(self) -> None:
        self.settings()

    def settings(self) -> DpSettings | None:
        """The validated DP settings (None: no DP)."""
        try:
            return dp_of(self)
        except PrivacyError as exc:
            raise SettingsError(str(exc)) from None


@dataclass(frozen=True)
class Validation(Concern):
    """How rounds are validated to choose the served one (the app adds who validates)."""

    eval_every: int = 5  # validate every k rounds and after the last
    val_samples: int = 5000  # validation examples of server-held data
    calib_samples: int = 500  # BN-calibration examples of server-held data (method §8)
    probe_variants: int = 3  # cached variants, evenly spaced by rank, averaged for checkpoint selection
    serve_average: int | None = (
        None  # last round's candidate: mean of this many rounds' weights (feast_edge.run.average)
    )

    def __post_init__(self) -> None:
        check(
            [
                (self.eval_every >= 1, f"--eval-every {self.eval_every} must be at least 1"),
                (
                    self.val_samples >= 1 and self.calib_samples >= 1,
                    "--val-samples and --calib-samples must be at least 1",
                ),
                (self.probe_variants >= 1, f"--probe-variants {self.probe_variants} must be at least 1"),
                (
                    self.serve_average is None or self.serve_average >= 1,
                    f"--serve-average {self.serve_average} must be at least 1 (1: serve the round's own weights)",
                ),
            ]
        )


@dataclass(frozen=True)
class SecureAggregation(Concern):
    """Secure aggregation per routed segment (feast_edge.secagg): the server sees each segment's sum over at least
    c + 2 devices, never one device's update."""

    secure_agg: bool = False
    colluders: int = 1  # c: devices besides the server that may collude
    secagg_bound: float = DEFAULT_BOUND  # |w · (θ' - θ_t)| per value, clipped before encoding
    secagg_neighbours: int = 0  # k of the SecAgg+ graph (0: every other member up to 16 devices, 2⌈log2 n⌉ beyond)

    def __post_init__(self) -> None:
        check(
            [
                (self.colluders >= 0, f"--colluders {self.colluders} must be >= 0"),
                (self.secagg_bound > 0, f"--secagg-bound {self.secagg_bound} must be > 0"),
                (
                    self.secagg_neighbours == 0 or self.secagg_neighbours >= 2 * self.colluders + 2,
                    f"--secagg-neighbours {self.secagg_neighbours} must be 0 (chosen from the cohort's size) or at "
                    f"least 2 · --colluders + 2 = {2 * self.colluders + 2}: each member must mask with more honest "
                    "neighbours than colluders",
                ),
            ]
        )


def secure_refusals(config: Any, devices: str = "device") -> list[tuple[bool, str]]:
    """What ``--secure-agg`` refuses in a run configuration (a ``SimulationConfig`` or ``ServerConfig``), as
    (allowed, why) pairs: what needs each update's value, weight or clipped-or-not bit at the server."""
    dp, agg = config.dp_settings(), config.aggregation
    return [
        (config.schedule.mode == "sync", "--secure-agg with --mode async: each update's staleness weight is known "
         "only when it arrives, and a masked update cannot be weighted alone; use synchronous rounds"),
        (agg.rule == "mean", f"--secure-agg with --aggregation {agg.rule}: a robust rule needs each {devices}'s "
         "update, and the server sees only sums; use --aggregation mean"),
        (config.server_optimizer().identity, f"--secure-agg with --server-opt {agg.server_opt}: the server "
         "optimizer's step needs each update; use --server-opt avg"),
        (dp is None or dp.mode == "central", f"--secure-agg with --dp-mode {dp.mode if dp else ''}: local DP's "
         "noise and secure sums are not combined (distributed DP on masked sums is not built): use --dp-mode "
         "central, whose noise the server adds to the unmasked sums"),
        (dp is None or not dp.adaptive, "--secure-agg with --dp-clip-quantile: the adaptive bound needs each "
         "update's clipped-or-not bit at the server; use a fixed --dp-clip"),
    ]  # fmt: skip


MODES = ("sync", "async")


@dataclass(frozen=True)
class Schedule(Concern):
    """Synchronous rounds (method §4, the default) or buffered asynchronous ones (feast_edge.run.asynchronous):
    K updates per release, M devices training at once, S releases of staleness at most, the discount s(τ)."""

    mode: str = "sync"
    buffer: int = 5  # K (async)
    concurrency: int = 10  # M (async)
    max_staleness: int = 10  # S (async)
    staleness: str = "sqrt"  # s(τ) (async): sqrt, constant or hinge

    def __post_init__(self) -> None:
        check([(self.mode in MODES, f"--mode {self.mode!r} is unknown; choose sync or async")])
        try:
            self.rules()
        except RunError as exc:
            raise SettingsError(str(exc)) from None

    def rules(self) -> AsyncSettings | None:
        """The validated asynchronous settings (None: synchronous rounds)."""
        if self.mode != "async":
            return None
        return AsyncSettings(self.buffer, self.concurrency, self.max_staleness, self.staleness)

    def release_step(self, opt: ServerOpt, lr_given: bool) -> ServerOpt:
        """The server's step: asynchronous releases by plain averaging without --server-lr move the model
        feast_edge.settings.buffered.SERVER_LR of the way to the buffer's mean; otherwise ``opt`` as given."""
        if self.mode != "async" or lr_given or opt.name != "avg":
            return opt
        return replace(opt, lr=SERVER_LR)


def server_step(config: Any, averaging: bool = True) -> ServerOpt:
    """The validated server step of a run's configuration: its --server-opt, as its schedule takes it."""
    opt = config.aggregation.optimizer(averaging)
    return config.schedule.release_step(opt, config.aggregation.server_lr is not None)
