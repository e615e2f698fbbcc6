"""A Flower run's config (``[tool.flwr.app.config]``, ``flwr run --run-config``) as feast-server's ServerConfig.

Keys are feast-server's option names without the dashes in front (``per-round`` for ``--per-round``), plus
``out-dir`` (the run directory, required: checkpoints, rounds.csv, devices.sqlite, models/), ``export``
(export each node's model after the last round; default true), ``personalize`` (after the last round, each node's
personalization step on its served variant: auto, off, METHOD or METHOD:STRENGTH; default off), ``node-data`` and
``node-holdout`` (read by the ClientApp on Flower's Simulation Engine: the partition directory the simulated nodes
take their shards from, and the share of each shard they hold out). Which of feast-server's settings a run config
takes is the settings' declaration (``apps``, feast_edge.settings.nested.setting); one it does not take is refused with
the reason of its concern (``FLOWER_REFUSES``). An unknown key, a refused one or a value of the wrong type is a
ServerError naming the key and what it takes.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from feast_edge.aggregate.server_opt import parse_betas
from feast_edge.data.holdout import MAX_HOLDOUT
from feast_edge.errors import PayloadError
from feast_edge.flower.records import check_flower_dtype
from feast_edge.flower.serverapp.environment import FLOWER
from feast_edge.personalize.select import Choice, PersonalizeError
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.settings.nested import accepted_by, concern_of_keys, flat_types

# Why a Flower run refuses the settings of each concern that it does not take (by the settings' declarations).
FLOWER_REFUSES = {
    # the features the Flower environment cannot run, with its capabilities' reasons (environment.FLOWER)
    "schedule": f"{FLOWER.asynchronous}: drop these keys",
    "secure": f"{FLOWER.secure}: drop these keys",
    "privacy": FLOWER.privacy,
    "network": "MQTT's chunking and the send wait have no meaning on a Grid, which sends its own messages: drop these "
    "keys",
    "validation": "the devices' BN statistics for a server without data, and the rule combining them, are feast-server "
    "run's over MQTT (a Flower run's nodes validate without data too, their counts combined by val-rule): drop these "
    "keys",
    "training": "--recipe KEY=VALUE pairs have no run-config form (a TOML table would need its own check): give lr, "
    "batch-size, epochs, lr-schedule or augment as keys of their own, and other [train] keys in the preset",
}
RENAMED = {"out": "out-dir"}  # a ServerConfig key the run config names otherwise
# node-data, node-holdout: the simulated nodes' partition and held-out share (ClientApp)
EXTRA = {"out-dir": str, "export": bool, "personalize": str, "node-data": str, "node-holdout": float}
EXAMPLE = 'e.g. [tool.flwr.app.config] out-dir = "/path/runs/flower-1"'


def _dashed(key: str) -> str:
    return key.replace("_", "-")


def run_config_keys() -> dict[str, Any]:
    """Every key a run config takes, and its type."""
    taken = set(accepted_by(ServerConfig, "flower")) - set(RENAMED)
    keys = {_dashed(key): kind for key, kind in flat_types(ServerConfig).items() if key in taken}
    return {**keys, **EXTRA}


def refused_keys() -> dict[str, str | None]:
    """Every ServerConfig key a run config refuses (dashed) -> its concern, whose reason ``FLOWER_REFUSES`` gives."""
    taken = set(accepted_by(ServerConfig, "flower"))
    return {_dashed(key): concern for key, concern in concern_of_keys(ServerConfig).items() if key not in taken}


def _refuse(run_config: Mapping[str, Any]) -> None:
    """A ServerError naming the keys of ``run_config`` that a Flower run refuses, with their concern's reason (the
    first concern in ``FLOWER_REFUSES`` order that has any)."""
    refused = refused_keys()
    for concern, reason in FLOWER_REFUSES.items():
        given = sorted(key for key in run_config if refused.get(key) == concern)
        if given:
            raise ServerError(f"run config {', '.join(given)}: {reason}")


def _value(key: str, value: Any, kind: Any) -> Any:
    """``value`` as a ServerConfig field of type ``kind`` takes it; ServerError naming ``key`` otherwise."""
    if key == "server-betas":
        try:
            return parse_betas(str(value)) if isinstance(value, str) else tuple(float(v) for v in value)
        except (TypeError, ValueError) as exc:
            raise ServerError(f"run config {key}: {exc}") from None
    allowed = [k for k in (typing.get_args(kind) or (kind,)) if k is not type(None)]
    for want in allowed:
        if want is bool and isinstance(value, bool):
            return value
        if want is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if want is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise ServerError(f"run config {key} = {value!r} must be a {names}")


def server_config(run_config: Mapping[str, Any]) -> tuple[ServerConfig, bool]:
    """The ServerConfig of a Flower run and whether to export the models after it; ServerError naming a bad key."""
    keys = run_config_keys()
    _refuse(run_config)
    unknown = sorted(k for k in run_config if k not in keys)
    if unknown:
        raise ServerError(
            f"run config has keys feast-edge does not know: {', '.join(unknown)}; it takes {', '.join(sorted(keys))}"
        )
    out = run_config.get("out-dir")
    if not isinstance(out, str) or not out:
        raise ServerError(f"run config needs out-dir, the run directory (an absolute path); {EXAMPLE}")
    if not Path(out).is_absolute():
        raise ServerError(
            f"run config out-dir {out!r} must be an absolute path (the ServerApp runs in Flower's directory); {EXAMPLE}"
        )
    settings = {
        key.replace("-", "_"): _value(key, value, keys[key])
        for key, value in run_config.items()
        if key not in EXTRA and value != ""
    }
    export = run_config.get("export", True)
    if not isinstance(export, bool):
        raise ServerError(f"run config export = {export!r} must be true or false")
    personalize_choice(run_config)
    holdout = run_config.get("node-holdout", "")
    if holdout != "" and (
        isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout <= MAX_HOLDOUT
    ):
        raise ServerError(f"run config node-holdout = {holdout!r} must be a fraction between 0 and {MAX_HOLDOUT}")
    config = ServerConfig.of(out=out, **settings)
    try:
        check_flower_dtype(config.aggregation.payload_dtype)
    except PayloadError as exc:
        raise ServerError(f"run config payload-dtype: {exc}") from None
    return config, export


def personalize_choice(run_config: Mapping[str, Any]) -> Choice:
    """The run config's ``personalize`` (default off); ServerError naming the choices."""
    try:
        return Choice.parse(str(run_config.get("personalize") or "off"))
    except PersonalizeError as exc:
        raise ServerError(f"run config personalize: {exc}".replace("--personalize ", "")) from None
