"""The federation server's settings: what decides the result (the run's fingerprint), where it lives, how it waits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.aggregate.server_opt import DEPLOYMENT_OPT, ServerOpt
from feast_edge.aggregate.weights import DEFAULT_WEIGHT_RATIO, ratio_problem
from feast_edge.errors import FeastError
from feast_edge.evaluate.bn_robust import BN_RULES, DEFAULT_BN_RULE
from feast_edge.evaluate.coverage import SERVING_RULES
from feast_edge.evaluate.federated import DEFAULT_VAL_RULE, VAL_RULES
from feast_edge.local.recipe import TrainConfig, TrainError, preset_recipe
from feast_edge.privacy.local import LocalDp
from feast_edge.privacy.settings import DpSettings, PrivacyError, check_composes, dp_of
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT
from feast_edge.run.settings import RunError, RunSettings, check_run_options, recorded_of, server_opt_of
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE

KIND = "federation"
# A field's key in the stored config and fingerprint, where it differs from the field's name: runs from before the
# ablation was called --variants stored it as "method", and keep resuming.
STORED_AS = {"variants": "method"}


class ServerError(FeastError):
    """The server cannot start, resume or continue with the given settings."""


SERVED_PRECISIONS = ("auto", "fp32", "int8")  # --precision: auto = the precision each device registered
BN_CALIBRATIONS = ("federated", "device")  # where a server without data has its served variants' BN calibrated


@dataclass(frozen=True)
class ServerConfig:
    """Everything that decides the federation's result, plus where it lives (``out``) and how it waits."""

    out: str
    preset: str = "fmnist-small"
    rounds: int = 10
    per_round: int = 5
    min_clients: int = 2
    start_clients: int | None = (
        None  # devices to wait for before the first round of this process (default: min_clients)
    )
    round_timeout: float = 300.0
    seed: int = 0
    lr: float | None = None  # None: the preset's [train] recipe (as batch_size, augment)
    batch_size: int | None = None
    variants: str = "full"  # FEAST's variants per batch: full, min, max, min+max or min+max+kd (method §7 ablations)
    augment: str | bool | None = None
    epochs: int | None = None  # local epochs per round (None: the recipe's)
    eval_every: int = 5
    data: str | None = None
    val_samples: int = 5000
    calib_samples: int = 500
    bn_calibration: str = "federated"  # without data: "federated" (the devices' statistics, combined) or "device"
    # Which variant a device is served: "validated" (its largest affordable unless a smaller affordable one is clearly
    # better on the federation's validation) or "largest" (method §8's largest affordable, whatever validation says).
    serving_rule: str = "validated"
    bn_rule: str = DEFAULT_BN_RULE  # how the devices' BN statistics are combined (feast_edge.evaluate.bn_robust)
    val_rule: str = (
        DEFAULT_VAL_RULE  # how the devices' held-out accuracies are combined (feast_edge.evaluate.federated)
    )
    probe_variants: int = 3
    cache: str | None = None
    federation: str = "feast"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    wait_timeout: float = (
        1800.0  # idle limit: seconds a round may wait for enough devices before the run ends (0: forever)
    )
    send_timeout: float = 120.0
    max_samples: int = 1_000_000  # the most training examples a device may register (its aggregation weight)
    max_devices: int = 10_000  # the most devices the registry takes
    aggregation: str = "mean"  # mean (method §6), clip, trimmed-mean or median (feast_edge.aggregate.robust)
    trim: float = 0.1  # trimmed-mean: share of the covering values dropped at each end of a position
    clip_norm: float | None = None  # clip: L2 bound of an update (None: the cohort's median update norm)
    max_update_norm: float = (
        1e4  # L2 bound on an update's change of its routed slice (0: none); honest fmnist-small epochs: 14-62
    )
    payload_dtype: str = (
        "float32"  # of routed payloads and updates on the wire (aggregation and the model stay float32)
    )
    # A self-reported sample count weighs at most this many times the round's lower-median count (0: no cap); counts
    # the server's partition record holds are facts and never capped (feast_edge.aggregate.weights).
    max_weight_ratio: float = DEFAULT_WEIGHT_RATIO
    # The precision of the served ONNX files: "auto" serves each device the precision its profile was measured at
    # (the registration's), fp32 / int8 serve every device that one (feast_edge.evaluate.quantize).
    precision: str = "auto"
    int8_samples: int = (
        256  # images that set the int8 activation ranges (the server's calibration split, or a device's)
    )
    int8_tolerance: float = 0.01  # accuracy an int8 file may lose against float32 on held-out data before it is refused
    # The server's step from each round's aggregate (feast_edge.aggregate.server_opt; avg with lr 1: method §6 itself).
    server_opt: str = DEPLOYMENT_OPT
    server_lr: float | None = None  # None: the rule's default (feast_edge.aggregate.server_opt.DEFAULT_LR)
    server_momentum: float = 0.9
    server_betas: tuple[float, ...] = (0.9, 0.99)
    server_tau: float = 1e-3
    # Client-level differential privacy (feast_edge.privacy, docs/privacy.md): dp_clip and dp_noise together, or neither.
    dp_clip: float | None = None
    dp_noise: float | None = None
    dp_delta: float | None = None  # None: 1e-5 or 0.1/population (the first round's), whichever is smaller
    dp_epsilon: float | None = None  # the privacy budget; None: no limit
    dp_seed: int | None = None  # None: noise from the OS (not reproducible)
    dp_mode: str = "central"
    dp_clip_quantile: float | None = None  # adaptive clipping toward this quantile of the update norms; None: fixed
    dp_clip_lr: float = 0.2
    dp_clip_count_std: float | None = None  # None: a tenth of the privacy on the unclipped count

    def __post_init__(self) -> None:
        checks = [
            (self.rounds >= 1, f"--rounds {self.rounds} must be at least 1"),
            (self.min_clients >= 1, f"--min-clients {self.min_clients} must be at least 1"),
            (
                self.per_round >= self.min_clients,
                f"--per-round {self.per_round} must be at least --min-clients {self.min_clients} (a round needs that many valid updates)",
            ),
            (
                self.start_clients is None or self.start_clients >= self.min_clients,
                f"--start-clients {self.start_clients} must be at least --min-clients {self.min_clients}",
            ),
            (self.round_timeout > 0, f"--round-timeout {self.round_timeout} must be > 0 seconds"),
            (self.eval_every >= 1, f"--eval-every {self.eval_every} must be at least 1"),
            (self.wait_timeout >= 0, f"--wait-timeout {self.wait_timeout} must be >= 0 seconds (0: wait forever)"),
            (self.max_samples >= 1, f"--max-samples {self.max_samples} must be at least 1"),
            (self.max_devices >= 1, f"--max-devices {self.max_devices} must be at least 1"),
            (self.max_update_norm >= 0, f"--max-update-norm {self.max_update_norm} must be >= 0 (0: no bound)"),
            (not ratio_problem(self.max_weight_ratio), ratio_problem(self.max_weight_ratio)),
            (
                self.precision in SERVED_PRECISIONS,
                f"--precision {self.precision!r} must be one of {', '.join(SERVED_PRECISIONS)} (auto: each device's profile)",
            ),
            (self.int8_samples >= 1, f"--int8-samples {self.int8_samples} must be at least 1"),
            (
                0 <= self.int8_tolerance <= 1,
                f"--int8-tolerance {self.int8_tolerance:g} must be a fraction in [0, 1] (0.01 = 1 point)",
            ),
            (self.bn_rule in BN_RULES, f"--bn-rule {self.bn_rule!r} must be one of {', '.join(BN_RULES)}"),
            (self.val_rule in VAL_RULES, f"--val-rule {self.val_rule!r} must be one of {', '.join(VAL_RULES)}"),
            (
                self.serving_rule in SERVING_RULES,
                f"--serving-rule {self.serving_rule!r} must be one of {', '.join(SERVING_RULES)}",
            ),
            (
                self.bn_calibration in BN_CALIBRATIONS,
                f"--bn-calibration {self.bn_calibration!r} must be one of {', '.join(BN_CALIBRATIONS)}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ServerError(message)
        try:
            check_run_options(self.payload_dtype, self.aggregation, self.trim, self.clip_norm)
            self.server_optimizer()
        except RunError as exc:
            raise ServerError(str(exc)) from None
        try:
            if self.dp_settings() is not None:
                check_composes(self.aggregation, True, "feast")
        except PrivacyError as exc:
            raise ServerError(str(exc)) from None

    def dp_settings(self) -> DpSettings | None:
        """The run's DP settings (None: no DP)."""
        try:
            return dp_of(self)
        except PrivacyError as exc:
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
        """The validated server optimizer of ``--server-opt`` and its settings."""
        return server_opt_of(self.server_opt, self.server_lr, self.server_momentum, self.server_betas, self.server_tau)

    def recipe(self) -> tuple[TrainConfig, str]:
        """The local-training settings every device receives and the lr schedule: the preset's recipe, then these options."""
        try:
            return preset_recipe(
                self.preset,
                lr=self.lr,
                batch_size=self.batch_size,
                variants=self.variants,
                augment=self.augment,
                epochs=self.epochs,
            )
        except TrainError as exc:
            raise ServerError(f"training recipe: {exc}") from None

    def train_config(self) -> TrainConfig:
        return self.recipe()[0]

    def decisive(self) -> dict[str, Any]:
        """The settings that change the trained weights (a resumed run must keep them), the resolved recipe included."""
        names = (
            "preset",
            "rounds",
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
        train, schedule = self.recipe()
        recorded = recorded_of(self, train, schedule)
        capped = {"max_weight_ratio": self.max_weight_ratio} if self.max_weight_ratio else {}
        return {**{STORED_AS.get(name, name): getattr(self, name) for name in names}, **recorded, **capped}

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
        known, names = {f.name for f in dataclasses.fields(cls)}, {key: name for name, key in STORED_AS.items()}
        stored = {names.get(k, k): v for k, v in fields.get("config", {}).items() if names.get(k, k) in known}
        settings = {**stored, "data": fields.get("data"), **{k: v for k, v in overrides.items() if v is not None}}
        return cls(out=str(out), **settings)

    def settings(self) -> RunSettings:
        return RunSettings(
            rounds=self.rounds,
            per_round=self.per_round,
            min_clients=self.min_clients,
            seed=self.seed,
            lr=self.train_config().lr,
            eval_every=self.eval_every,
            probe_variants=self.probe_variants,
            aggregation=self.aggregation,
            trim=self.trim,
            clip_norm=self.clip_norm,
            lr_schedule=self.recipe()[1],
            payload_dtype=self.payload_dtype,
            max_weight_ratio=self.max_weight_ratio,
            server_opt=self.server_optimizer(),
            dp=self.dp_settings(),
            dp_on_devices=self.local_dp() is not None,
        )
