"""The federation server's settings: what decides the result (the run's fingerprint), where it lives, how it waits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feast_edge.aggregate.server_opt import DEPLOYMENT_OPT, ServerOpt
from feast_edge.aggregate.weights import DEFAULT_WEIGHT_RATIO
from feast_edge.errors import FeastError
from feast_edge.evaluate.bn_robust import BN_RULES, DEFAULT_BN_RULE
from feast_edge.evaluate.federated import DEFAULT_VAL_RULE, VAL_RULES
from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.local import LocalDp
from feast_edge.privacy.settings import DpSettings, PrivacyError, check_composes
from feast_edge.protocol.secure import MAX_HOLDERS, MAX_SECURE_COHORT
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT
from feast_edge.secagg.protocol import degree_for
from feast_edge.server.serving_concern import Serving
from feast_edge.settings import Aggregation, Concern, Population, Privacy, SettingsError, Training, Validation, flat
from feast_edge.settings.concerns import (
    Schedule,
    SecureAggregation,
    async_refusals,
    continuous_refusals,
    secure_refusals,
    server_step,
)
from feast_edge.settings.nested import changed, check, flat_types, of, setting
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.shared import CACHE, PRESET, ROUND_TIMEOUT, SEED
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE

KIND = "federation"
# A field's key in the stored config and fingerprint, where it differs from the field's name: runs from before the
# ablation was called --variants stored it as "method", and keep resuming.
STORED_AS = {"variants": "method"}


class ServerError(FeastError):
    """The server cannot start, resume or continue with the given settings."""


BN_CALIBRATIONS = ("federated", "device")  # where a server without data has its served variants' BN calibrated


@dataclass(frozen=True)
class Fleet(Population):
    """The devices: how many a round needs and samples, and what the registry takes."""

    min_clients: int = setting(
        2, min=1, help="K: devices needed online to start a round, and valid updates needed to change the model."
    )
    start_clients: int | None = setting(
        None, min=1, help="Devices to wait for before the first round (default: --min-clients)."
    )
    max_samples: int = setting(
        1_000_000,
        min=1,
        help="Refuse a device that registers more training examples than this (its aggregation weight); a "
        "partition's own counts apply to its clients.",
    )
    max_devices: int = setting(
        10_000, min=1, help="Refuse registrations beyond this many devices (bounds the registry)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            [
                (self.min_clients >= 1, f"--min-clients {self.min_clients} must be at least 1"),
                (
                    self.per_round >= self.min_clients,
                    f"--per-round {self.per_round} must be at least --min-clients {self.min_clients} (a round needs "
                    "that many valid updates)",
                ),
                (
                    self.start_clients is None or self.start_clients >= self.min_clients,
                    f"--start-clients {self.start_clients} must be at least --min-clients {self.min_clients}",
                ),
                (self.max_samples >= 1, f"--max-samples {self.max_samples} must be at least 1"),
                (self.max_devices >= 1, f"--max-devices {self.max_devices} must be at least 1"),
            ]
        )


@dataclass(frozen=True)
class DeviceAggregation(Aggregation):
    """The aggregation of updates from devices, which may lie: each update's change is bounded."""

    # Honest fmnist-small updates: 14-62.
    max_update_norm: float = setting(
        1e4, min=0.0, help="Reject an update that changes its routed slice by more than this L2 norm (0: no bound)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check([(self.max_update_norm >= 0, f"--max-update-norm {self.max_update_norm} must be >= 0 (0: no bound)")])


def _deployment_aggregation() -> DeviceAggregation:
    """A deployment's defaults: its server optimizer, and self-reported counts capped."""
    return DeviceAggregation(server_opt=DEPLOYMENT_OPT, max_weight_ratio=DEFAULT_WEIGHT_RATIO)


@dataclass(frozen=True)
class FederatedChecks(Validation):
    """How a server without data validates: the devices' BN statistics and held-out accuracies, combined."""

    # The devices' BN statistics are the MQTT server's (feast_edge.evaluate.bn_robust).
    bn_calibration: str = setting(
        "federated",
        apps=("server",),
        help="Without --data, where each served variant's BN statistics come from: federated (every device that can "
        "run it reports per-channel moments of its data, the server combines them) or device (each device "
        "recalibrates on its own data only).",
    )
    bn_rule: str = setting(
        DEFAULT_BN_RULE,
        apps=("server",),
        help="How the devices' BN statistics are combined: screened (refuse reports far from the median of all, mix "
        "the rest; a lone pair that disagrees is not used), median (per-channel weighted median) or mixture (every "
        "report as sent: one lying device steers it). docs/security.md §9.",
    )
    # feast_edge.evaluate.federated
    val_rule: str = setting(
        DEFAULT_VAL_RULE,
        help="How the devices' held-out accuracies are combined: median (each device one vote; chooses the served "
        "round only with 3 or more devices) or pooled (all counts summed, each capped by --max-weight-ratio).",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            [
                (self.bn_rule in BN_RULES, f"--bn-rule {self.bn_rule!r} must be one of {', '.join(BN_RULES)}"),
                (self.val_rule in VAL_RULES, f"--val-rule {self.val_rule!r} must be one of {', '.join(VAL_RULES)}"),
                (
                    self.bn_calibration in BN_CALIBRATIONS,
                    f"--bn-calibration {self.bn_calibration!r} must be one of {', '.join(BN_CALIBRATIONS)}",
                ),
            ]
        )


@dataclass(frozen=True)
class Network(Concern):
    """How the server waits on the broker and the devices."""

    round_timeout: float = setting(300.0, min=0.1, help=ROUND_TIMEOUT)
    wait_timeout: float = setting(
        1800.0,
        min=0.0,
        help="Idle limit: end the run (last round checkpointed) when a round waited this long for enough devices "
        "(0: wait forever).",
    )
    # MQTT's: a Flower run's Grid sends its own messages.
    send_timeout: float = setting(120.0, apps=("server",))
    chunk_size: int = setting(
        DEFAULT_CHUNK_SIZE,
        min=1024,
        max=16 * 1024 * 1024,
        apps=("server",),
        help="Chunk size in bytes for model payloads, and the largest chunk accepted.",
    )

    def __post_init__(self) -> None:
        check(
            [
                (self.round_timeout > 0, f"--round-timeout {self.round_timeout} must be > 0 seconds"),
                (self.wait_timeout >= 0, f"--wait-timeout {self.wait_timeout} must be >= 0 seconds (0: wait forever)"),
            ]
        )


@dataclass(frozen=True)
class SecureRounds(SecureAggregation):
    """Secure aggregation over MQTT: its concern's terms, and how long each key stage waits for the devices."""

    secagg_timeout: float = setting(
        60.0,
        help="--secure-agg: seconds each key stage (keys, sealed shares, unmasking) waits for the devices still in the "
        "round; a device that misses one is out of the round.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check([(self.secagg_timeout > 0, f"--secagg-timeout {self.secagg_timeout} must be > 0 seconds")])


@dataclass(frozen=True)
class ServerConfig:
    """Everything that decides the federation's result, by concern, plus where it lives (``out``) and how it waits.
    ``ServerConfig.of(out=..., per_round=3, ...)`` takes the settings flat, by their keys, as the command line, stored
    runs and Flower's run config give them."""

    out: str
    preset: str = setting("fmnist-small", help=PRESET)
    seed: int = setting(0, help=SEED)
    data: str | None = setting(
        None,
        help="Server-held validation/calibration data: a partition directory (feast-edge partition), a Fashion-MNIST "
        "or CIFAR directory (its test split), or an image folder or manifest CSV (labelled by the preset's class "
        "names). Without it the server holds no data: the devices validate on their held-out splits and calibrate "
        "their own models.",
    )
    cache: str | None = setting(None, help=CACHE)
    federation: str = "feast"
    population: Fleet = field(default_factory=Fleet)
    training: Training = field(default_factory=Training)
    aggregation: DeviceAggregation = field(default_factory=_deployment_aggregation)
    privacy: Privacy = field(default_factory=Privacy)
    validation: FederatedChecks = field(default_factory=FederatedChecks)
    serving: Serving = field(default_factory=Serving)
    network: Network = field(default_factory=Network)
    schedule: Schedule = field(default_factory=Schedule)
    secure: SecureRounds = field(default_factory=SecureRounds)

    @classmethod
    def of(cls, **settings: Any) -> ServerConfig:
        """The configuration with ``settings`` (by key) changed from the defaults; a ServerError naming a bad one."""
        try:
            return of(cls, **settings)
        except SettingsError as exc:
            raise ServerError(str(exc)) from None

    def changed(self, **settings: Any) -> ServerConfig:
        """This configuration with ``settings`` (by key) changed."""
        try:
            return changed(self, **settings)
        except SettingsError as exc:
            raise ServerError(str(exc)) from None

    def __post_init__(self) -> None:
        try:
            if self.dp_settings() is not None:
                check_composes(self.aggregation.rule, True, "feast")
        except PrivacyError as exc:
            raise ServerError(str(exc)) from None
        self._check_schedule()
        self._check_secure()
        for ok, message in continuous_refusals(self):
            if not ok:
                raise ServerError(message)
        self._check_serve_average()

    def _check_serve_average(self) -> None:
        """--serve-average K > 1 only where rounds are validated: the mean is served only once it beats the round's
        own weights on held-out data, and without --data under DP no device sends held-out counts."""
        k = self.validation.serve_average
        if k is not None and k > 1 and self.data is None and not self.federated_statistics:
            raise ServerError(
                f"--serve-average {k}: this run validates no round (under DP without --data the devices send no "
                "held-out counts: they would leave them unnoised), so the mean of the last rounds' weights could never "
                "be compared with the last round's own, which is what is served; drop --serve-average, or give the "
                "server a validation split with --data"
            )

    def _check_secure(self) -> None:
        """Secure sums over MQTT: what needs each device's update, or a cohort the stages cannot carry, is refused."""
        if not self.secure.secure_agg:
            return
        n = self.population.per_round
        degree = degree_for(n, self.secure.secagg_neighbours)
        holders = n - 1 if not degree else min(n - 1, 2 * ((degree + 1) // 2))  # the devices one device's shares go to
        checks = [
            *secure_refusals(self),
            (self.population.per_round <= MAX_SECURE_COHORT, f"--secure-agg with --per-round "
             f"{self.population.per_round}: a round's roster of keys travels in one message, which holds at most "
             f"{MAX_SECURE_COHORT} devices'"),
            (holders <= MAX_HOLDERS, f"--secure-agg with --per-round {self.population.per_round} and "
             f"--secagg-neighbours {self.secure.secagg_neighbours}: each device's sealed shares for its {holders} "
             f"neighbours travel in one message, which holds at most {MAX_HOLDERS}: give --secagg-neighbours "
             f"{MAX_HOLDERS} or fewer (0 chooses 2⌈log2 n⌉)"),
            (self.population.per_round >= self.secure.colluders + 2, f"--secure-agg with --per-round "
             f"{self.population.per_round}: a segment is revealed only over --colluders + 2 = "
             f"{self.secure.colluders + 2} devices; sample at least that many"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ServerError(message)

    def _check_schedule(self) -> None:
        """Buffered asynchronous rounds (server.jobs): what needs the devices between releases is refused."""
        rules = self.schedule
        if rules.mode != "async":
            return
        checks = [
            *async_refusals(self),
            (
                self.data is not None
                or not self.federated_statistics
                or self.validation.eval_every >= self.training.rounds,
                f"--mode async without --data: the devices would validate the model every {self.validation.eval_every} "
                "releases, but in asynchronous rounds they are training (a validation would wait for them all, the "
                "barrier async mode removes): give --data to validate on the server, or --eval-every "
                f"{self.training.rounds} to validate once, after the last release",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ServerError(message)

    def dp_settings(self) -> DpSettings | None:
        """The run's DP settings (None: no DP)."""
        try:
            return self.privacy.settings()
        except SettingsError as exc:
            raise ServerError(str(exc)) from None

    def local_dp(self) -> LocalDp | None:
        """What every cohort device is asked to apply to its own update (``--dp-mode local``); None otherwise."""
        dp = self.dp_settings()
        return LocalDp(dp.clip, dp.noise, dp.seed) if dp is not None and dp.mode == "local" else None

    @property
    def federated_statistics(self) -> bool:
        """Whether devices send statistics of their data besides their clipped updates (BN statistics of the served
        variants, held-out accuracy counts). Not under DP: they would leave the devices unnoised."""
        return self.dp_settings() is None

    def server_optimizer(self) -> ServerOpt:
        """The validated server step of ``--server-opt`` as this run's rounds take it (asynchronous releases by plain
        averaging step feast_edge.run.asynchronous.SERVER_LR of the way; feast_edge.settings.concerns.server_step)."""
        return server_step(self)

    def recipe(self) -> tuple[TrainConfig, str]:
        """The local-training settings every device receives and the lr schedule: the preset's recipe, then these options."""
        try:
            return self.training.recipe_of(self.preset)
        except SettingsError as exc:
            raise ServerError(str(exc)) from None

    def train_config(self) -> TrainConfig:
        return self.recipe()[0]

    def decisive(self) -> dict[str, Any]:
        """The settings that change the trained weights (a resumed run must keep them), the resolved recipe included."""
        names = (
            "preset",
            "per_round",
            "min_clients",
            "seed",
            "lr",
            "batch_size",
            "variants",
            "augment",
            "cache",
            "federation",
        )
        values = flat(self)
        train, schedule = self.recipe()
        recorded = self.aggregation.recorded(train, schedule, self.dp_settings())
        ratio = self.aggregation.max_weight_ratio
        capped = {"max_weight_ratio": ratio} if ratio else {}
        asynchronous = {k: values[k] for k in flat_types(Schedule)} if self.schedule.mode == "async" else {}
        secure = (
            {k: values[k] for k in ("secure_agg", "colluders", "secagg_bound")} if self.secure.secure_agg else {}
        )  # what is withheld and how values are encoded
        # Without a horizon, the rounds decide nothing (feast-server stop ends the run); a run may be extended with
        # another --rounds or --continuous (feast_edge.run.store.EXTENDABLE).
        horizon = ("continuous", "lr_period") if self.training.continuous else ("rounds",)
        return {
            **{STORED_AS.get(name, name): values[name] for name in (*names, *horizon)},
            **recorded,
            **capped,
            **asynchronous,
            **secure,
        }

    @classmethod
    def stored(cls, out: str | Path, **overrides: Any) -> ServerConfig:
        """The configuration of the run in ``out``, from its checkpoint (for export and serving after the run)."""
        path = Path(out) / CHECKPOINT
        if not path.is_file():
            raise ServerError(
                f"no federation checkpoint at {path}; point --out at a directory written by feast-server run"
            )
        fields = read_record(path).get("fields", {})
        if fields.get("kind") != KIND:
            raise ServerError(
                f"{path} is not a federation checkpoint; point --out at a directory written by feast-server run"
            )
        known, names = set(flat_types(cls)), {key: name for name, key in STORED_AS.items()}
        stored = {names.get(k, k): v for k, v in fields.get("config", {}).items() if names.get(k, k) in known}
        settings = {**stored, "data": fields.get("data"), **{k: v for k, v in overrides.items() if v is not None}}
        return cls.of(**{**settings, "out": str(out)})

    def run_concerns(self) -> RunConcerns:
        """What the round loop reads of this configuration (feast_edge.settings.run_concerns)."""
        try:
            return RunConcerns.of(
                self, min_clients=self.population.min_clients, dp_on_devices=self.local_dp() is not None
            )
        except SettingsError as exc:
            raise ServerError(str(exc)) from None
