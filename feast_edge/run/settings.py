"""A run's settings: what the loop reads, their one check, and what a run's fingerprint records of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from feast_edge.aggregate.robust import check_rule, rule_settings
from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.aggregate.weights import ratio_problem
from feast_edge.errors import FeastError
from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.settings import DpSettings
from feast_edge.route.payload import PAYLOAD_DTYPES


class RunError(FeastError):
    """A run cannot start or resume with the given settings."""


@dataclass(frozen=True)
class RunSettings:
    """The settings of the loop itself (everything else the caller records in ``config``)."""

    rounds: int
    per_round: int
    min_clients: int
    seed: int
    lr: float
    eval_every: int = 5
    probe_variants: int = 3
    serve_average: int | None = None  # the last round's candidate: the mean of this many rounds' weights (None: 5
    # where devices validate, 1 on server-held data; feast_edge.run.average)
    device: str = "cpu"
    aggregation: str = "mean"  # mean (method §6), clip, trimmed-mean or median (feast_edge.aggregate.robust)
    trim: float = 0.1  # trimmed-mean: share of the covering values dropped at each end of a position
    clip_norm: float | None = None  # clip: L2 bound of an update (None: the cohort's median update norm)
    lr_schedule: str = "cosine"  # feast_edge.local.recipe.SCHEDULES, over the federation horizon
    payload_dtype: str = (
        "float32"  # of the payloads on the wire (feast_edge.route.payload.PAYLOAD_DTYPES); the model stays float32
    )
    max_weight_ratio: float = 0.0  # a self-reported count weighs at most this many median counts (0: no cap)
    server_opt: ServerOpt = field(
        default_factory=ServerOpt
    )  # the step from the aggregate (feast_edge.aggregate.server_opt); avg: method §6
    dp: DpSettings | None = None  # client-level differential privacy (feast_edge.privacy); None: none
    dp_on_devices: bool = False  # local DP applied by real devices (a server): their updates arrive noised
    compute_budget: float = 0.0  # end the run once the released updates' training MACs reach this (0: no budget)
    # secure aggregation (--secure-agg): a segment's sum is revealed only over at least this many devices, c + 2
    # (feast_edge.run.stratified); 0: plain sums
    reveal_over: int = 0

    def __post_init__(self) -> None:
        check_run_options(self.payload_dtype, self.aggregation, self.trim, self.clip_norm)
        problem = ratio_problem(self.max_weight_ratio)
        if problem:
            raise RunError(problem)


def check_run_options(payload_dtype: str, aggregation: str, trim: float, clip_norm: float | None) -> None:
    """The one check of a run's payload dtype and aggregation rule (RunSettings, feast_edge.settings.Aggregation): a RunError naming the option."""
    if payload_dtype not in PAYLOAD_DTYPES:
        raise RunError(f"--payload-dtype {payload_dtype!r} is not supported; choose one of {', '.join(PAYLOAD_DTYPES)}")
    try:
        check_rule(aggregation, trim, clip_norm)
    except ValueError as exc:
        raise RunError(str(exc)) from None


def recorded_settings(
    train: TrainConfig,
    schedule: str,
    aggregation: str,
    trim: float,
    clip_norm: float | None,
    payload_dtype: str,
    server_opt: ServerOpt | None = None,
    dp: DpSettings | None = None,
) -> dict[str, Any]:
    """What every run's fingerprint records of its recipe, aggregation and wire: the resolved recipe, the aggregation
    settings its rule reads (none for the mean), a payload dtype other than float32 and a server optimizer other than
    plain averaging (runs without them keep their earlier fingerprints)."""
    wire = {} if payload_dtype == "float32" else {"payload_dtype": payload_dtype}
    opt = server_opt.settings() if server_opt is not None else {}
    return {
        "train": train.settings(),
        "lr_schedule": schedule,
        **rule_settings(aggregation, trim, clip_norm),
        **wire,
        **opt,
        **(dp.settings() if dp is not None else {}),
    }


def server_opt_of(
    name: str, lr: float | None, momentum: float, betas: tuple[float, ...], tau: float, averaging: bool = True
) -> ServerOpt:
    """The one check of a run's --server-* options (feast_edge.settings.Aggregation): a RunError naming the option."""
    try:
        opt = ServerOpt(name, lr, momentum, tuple(betas), tau)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    if not averaging and not opt.identity:
        raise RunError(
            f"--server-opt {name} needs a method whose aggregation is an average; this one trains or aggregates "
            "otherwise: drop --server-opt/--server-lr"
        )
    return opt
