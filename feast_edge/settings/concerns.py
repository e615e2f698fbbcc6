"""The concerns both a simulation and a federation server are configured by: how devices train, how their updates
become the model, the privacy of those updates, and how rounds are validated (each app adds its own to them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from feast_edge.aggregate.server_opt import DEFAULT_LR, ServerOpt
from feast_edge.aggregate.weights import ratio_problem
from feast_edge.local.recipe import CONTINUOUS_PERIOD, TrainConfig, TrainError, preset_recipe
from feast_edge.privacy.settings import DpSettings, PrivacyError, dp_of
from feast_edge.secagg.fixed import DEFAULT_BOUND
from feast_edge.settings.buffered import SERVER_LR, AsyncSettings
from feast_edge.settings.nested import Concern, Help, SettingsError, check, setting
from feast_edge.settings.validated import RunError, check_run_options, recorded_settings, server_opt_of


@dataclass(frozen=True)
class Population(Concern):
    """Who trains in a round: the cohort's size (the app adds where its devices come from)."""

    per_round: int = setting(5, min=1, help="Clients sampled per round (m).")

    def __post_init__(self) -> None:
        check([(self.per_round >= 1, f"--per-round {self.per_round} must be at least 1")])


@dataclass(frozen=True)
class Training(Concern):
    """How each device trains: the rounds' horizon and the local recipe (None: the preset's [train] value)."""

    rounds: int = setting(
        10,
        min=1,
        help=Help(
            "Federation rounds (also the cosine-decay horizon); with --continuous, where this invocation stops.",
            server="With --continuous it is not used: the run goes on until feast-server stop.",
        ),
    )
    continuous: bool = setting(
        False,
        apps=("simulation", "server"),
        help="Rounds without a horizon: the learning rate restarts its cosine every --lr-period rounds, the served "
        'round is chosen at every validation (docs/method.md, "A federation without an end").',
    )
    lr_period: int = setting(
        CONTINUOUS_PERIOD,
        min=0,
        apps=("simulation", "server"),
        help="With --continuous: rounds of one cosine cycle of the learning rate, restarted at its peak (SGDR); 0: "
        "the constant learning rate.",
    )
    lr: float | None = setting(
        None, help="Initial SGD learning rate, decayed over --rounds (default: the preset's [train] recipe)."
    )
    batch_size: int | None = setting(None, min=1, help="Local batch size (default: the preset's [train] recipe).")
    variants: str = setting(
        "full", help="FEAST's variants per batch: full, min, max, min+max or min+max+kd (the paper's ablations)."
    )
    # feast_edge.local.augment.POLICIES (True/False: method §7's policy / none)
    augment: str | bool | None = setting(
        None,
        help="Augmentation policy: randaugment+mix (method §7), crop-flip+mix, crop-flip, randaugment or none "
        "(default: the preset's [train] recipe).",
    )
    epochs: int | None = setting(None, min=1, help="Local epochs per round (default: the preset's [train] recipe).")
    lr_schedule: str | None = setting(
        None, help="cosine or constant over the rounds (default: the preset's [train] recipe)."
    )
    # Further [train] keys to override (--recipe KEY=VALUE), sorted; a Flower run config has no form for them.
    recipe: tuple[tuple[str, Any], ...] = setting((), apps=("simulation", "server"))

    def __post_init__(self) -> None:
        recipe = tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in dict(self.recipe).items()))
        object.__setattr__(self, "recipe", recipe)
        check(
            [
                (self.rounds >= 1, f"--rounds {self.rounds} must be at least 1"),
                (self.lr_period >= 0, f"--lr-period {self.lr_period} must be 0 (constant) or a number of rounds"),
            ]
        )

    @property
    def horizon(self) -> int | None:
        """The rounds the run's schedules are defined over: ``rounds``, or None with --continuous (no end)."""
        return None if self.continuous else self.rounds

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

    rule: str = setting(
        "mean",
        key="aggregation",
        help="mean (method §6) or a robust rule over the clients covering each position: clip (norm clipping), "
        "trimmed-mean or median (docs/security.md §5).",
    )
    trim: float = setting(
        0.1, help="trimmed-mean: share of the values covering a position dropped at each end, in [0, 0.5)."
    )
    clip_norm: float | None = setting(
        None, help="clip: L2 bound of each update's change (default: the median update norm of the round's cohort)."
    )
    max_weight_ratio: float = setting(
        0.0,
        help=Help(
            "Cap each client's self-reported sample count, its weight, at this many times the round's lower-median "
            "count (0: no cap; docs/security.md §5).",
            simulation="Each shard's size is taken as self-reported, as feast-server run takes a device's count.",
            server="The counts of a partition given as --data are never capped.",
        ),
    )
    payload_dtype: str = setting(
        "float32",
        help="Payloads on the wire, both directions: float32, float16 or bfloat16 (aggregation and the model stay "
        "float32).",
    )
    server_opt: str = setting(
        "avg",
        help="The server's step from each round's sparse aggregate: avg (method §6), momentum (FedAvgM), adam "
        "(FedAdam) or yogi (FedYogi); routed positions only.",
    )
    server_lr: float | None = setting(
        None, help=f"Server learning rate (default: {', '.join(f'{n} {lr:g}' for n, lr in DEFAULT_LR.items())})."
    )
    server_momentum: float = setting(0.9, help="momentum: its coefficient, in [0, 1).")
    server_betas: tuple[float, ...] = setting(
        (0.9, 0.99), help="adam/yogi: β₁,β₂ of the first and second moments, each in [0, 1)."
    )
    server_tau: float = setting(1e-3, help="adam/yogi: adaptivity τ (> 0).")

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

    apps: ClassVar[tuple[str, ...]] = ("simulation", "server")  # Flower's ClientApp sends raw updates

    dp_clip: float | None = setting(
        None,
        help="Client-level differential privacy: clip each update of a routed slice to this L2 norm C (with "
        "--dp-noise; docs/privacy.md).",
    )
    dp_noise: float | None = setting(
        None,
        help="Noise multiplier z: N(0, z²C²) on every coordinate's sum of clipped updates, divided by the number of "
        "devices routed that coordinate.",
    )
    dp_delta: float | None = setting(
        None, help="δ of the reported ε; below 1/population (default: 1e-5 or 0.1/population)."
    )
    dp_epsilon: float | None = setting(
        None, help="Privacy budget: refuse a run whose planned rounds exceed it; stop before a round that would."
    )
    dp_seed: int | None = setting(
        None, help="Seed the noise (tests only: default noise comes from the OS, never replayed)."
    )
    dp_mode: str = setting(
        "central",
        help="central (the server adds the noise: trusts the server) or local (each device noises its own clipped "
        "update: trusts nobody, costs accuracy).",
    )
    dp_clip_quantile: float | None = setting(
        None,
        help="Adaptive clipping (central DP): start at --dp-clip and move the bound each round toward this quantile "
        "of the update norms, privately (e.g. 0.5; Andrew et al. 2021).",
    )
    dp_clip_lr: float = setting(0.2, help="Adaptive clipping: the geometric step of the bound per round.")
    dp_clip_count_std: float | None = setting(
        None,
        help="Adaptive clipping: noise std on the count of unclipped updates (default: a tenth of the privacy, 1.58 "
        "z; the updates' noise grows so ε stays that of --dp-noise).",
    )

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

    eval_every: int = setting(
        5,
        min=1,
        help=Help(
            "Validate the model every k rounds and after the last, keeping the best round's.",
            server="It validates on --data, or without it on the held-out examples of the round's devices (feast-agent run "
            "--holdout).",
        ),
    )
    val_samples: int = setting(
        5000, min=1, help=Help("Server-held validation examples.", server="They come from --data.")
    )
    calib_samples: int = setting(
        500,
        min=1,
        help=Help(
            "Server-held BN-calibration examples (method §8).",
            server="They come from --data, or, without it, are what each device recalibrates on.",
        ),
    )
    probe_variants: int = 3  # cached variants, evenly spaced by rank, averaged for checkpoint selection
    serve_average: int | None = setting(
        None,
        min=1,
        help=Help(
            "The last round's second candidate: the mean of the last K rounds' weights, validated beside the round's "
            "own weights on the same held-out examples, the better offered to the served-round rule (1: the rounds' "
            "own weights).",
            simulation="Default: min(5, ⌈rounds/4⌉) with --validate-on devices, 1 on the server's split (the paper's "
            "selection).",
            server="Default: min(5, ⌈rounds/4⌉) without --data, where the devices validate, 1 on --data.",
        ),
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

    apps: ClassVar[tuple[str, ...]] = ("simulation", "server")  # its stages are no Flower messages

    secure_agg: bool = setting(
        False,
        help=Help(
            "Secure aggregation per routed segment: the clients mask their updates and the server unmasks only each "
            "segment's sum over at least --colluders + 2 clients, never one client's update; a segment with fewer "
            "keeps its global value (docs/security.md §10).",
            server="Its messages over MQTT: docs/protocol.md §8.",
        ),
    )
    colluders: int = setting(
        1,
        help="--secure-agg: c, the clients besides the server that may collude; a segment's sum is revealed only over "
        "at least c + 2 clients.",
    )
    secagg_bound: float = setting(
        DEFAULT_BOUND,
        help="--secure-agg: each client's weighted change per value is clipped to +-this before 32-bit fixed-point "
        "encoding (what one client can add to a sum the server cannot check).",
    )
    secagg_neighbours: int = setting(
        0,
        help="--secure-agg: k, how many others each client masks with in each segment and seals its shares for "
        "(SecAgg+'s neighbour graph; 0: every other client up to 16 per round, 2*ceil(log2 n) beyond).",
    )

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


def async_refusals(config: Any) -> list[tuple[bool, str]]:
    """What ``--mode async`` refuses in a run configuration (a ``SimulationConfig`` or ``ServerConfig``), as
    (allowed, why) pairs: central DP's noise is calibrated to updates that weigh alike."""
    rules, dp = config.schedule, config.dp_settings()
    central = rules.mode == "async" and dp is not None and dp.mode == "central"
    why = (
        "--mode async with central DP weighs every buffered update alike (the noise is calibrated to uniform weights), "
        f"not by --staleness {rules.staleness}: add --staleness constant"
    )
    return [(not central or rules.staleness == "constant", why)]


def continuous_refusals(config: Any) -> list[tuple[bool, str]]:
    """What ``--continuous`` refuses in a run configuration (a ``SimulationConfig`` or ``ServerConfig``), as
    (allowed, why) pairs: what is defined over a horizon and has no form without one yet."""
    if not config.training.continuous:
        return []
    return [
        (config.schedule.mode == "sync", "--continuous with --mode async: the served model is chosen at validations "
         "between rounds, which asynchronous jobs do not pause for yet; use synchronous rounds"),
        (config.dp_settings() is None, "--continuous with differential privacy: the guarantee is accounted over "
         "the planned rounds, and a run without an end has none; give --rounds for a finite run"),
    ]  # fmt: skip


MODES = ("sync", "async")


@dataclass(frozen=True)
class Schedule(Concern):
    """Synchronous rounds (method §4, the default) or buffered asynchronous ones (feast_edge.run.asynchronous):
    K updates per release, M devices training at once, S releases of staleness at most, the discount s(τ)."""

    apps: ClassVar[tuple[str, ...]] = ("simulation", "server")  # Flower has no asynchronous strategy

    mode: str = setting(
        "sync",
        help=Help(
            "sync: the paper's rounds, each waiting for its cohort up to --round-timeout; async: buffered "
            "asynchronous rounds, released every --buffer updates, never waiting for the slowest client.",
            simulation='See docs/simulation.md, "Asynchronous rounds".',
            server='See docs/protocol.md, "Asynchronous rounds".',
        ),
    )
    buffer: int = setting(5, min=1, help="async: updates per release (K); --rounds counts releases.")
    concurrency: int = setting(
        10,
        min=1,
        help=Help(
            "async: clients training at once (M); a client that finishes frees its slot, refilled at once by a "
            "seeded uniform draw from the idle clients.",
            server="On a server, only online devices are drawn.",
        ),
    )
    max_staleness: int = setting(
        10,
        min=0,
        help="async: an update trained from a model more than this many releases old is refused and counted.",
    )
    staleness: str = setting(
        "sqrt",
        help="async: the discount of a stale update's weight: sqrt (1/sqrt(1+tau)), hinge (none up to 2, then "
        "1/(tau-1)), inverse (1/(1+tau)) or constant (central DP needs constant).",
    )

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
