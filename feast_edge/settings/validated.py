"""The validated forms of a run's options that its concerns share: the one check of its payload dtype and aggregation
rule, its server optimizer, what a run's fingerprint records of them, and the error a run's settings raise."""

from __future__ import annotations

from typing import Any

from feast_edge.aggregate.robust import check_rule, rule_settings
from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.errors import FeastError
from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.settings import DpSettings
from feast_edge.route.payload import PAYLOAD_DTYPES


class RunError(FeastError):
    """A run cannot start or resume with the given settings."""


def check_run_options(payload_dtype: str, aggregation: str, trim: float, clip_norm: float | None) -> None:
    """The one check of a run's payload dtype and aggregation rule (feast_edge.settings.Aggregation): a RunError naming the option."""
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
