"""The data and population options of ``feast-edge simulate`` and ``partition`` (method §4): clients, budgets, γ, the data set."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from feast_edge.cli.common import F, option_group, parse_list, parse_macs
from feast_edge.errors import FeastError
from feast_edge.settings.nested import bounds_of, defaults, help_of
from feast_edge.sim.config import SimulationConfig


def cycled_budgets(text: str, clients: int) -> tuple[float, ...]:
    """``--budgets`` list, repeated in order until every client has one."""
    values = [parse_macs(t) for t in parse_list(text)]
    if not values:
        raise FeastError("--budgets is empty; give at least one MAC budget, e.g. --budgets 2.79M,17.67M")
    return tuple(values[i % len(values)] for i in range(clients))


def population_budgets(
    budgets: str | None, profiles: str | None, clients: int, preset: str
) -> tuple[float, ...] | None:
    """Explicit client budgets from ``--budgets`` or ``--profiles`` (None: Zipf)."""
    if budgets is not None and profiles is not None:
        raise FeastError("--budgets and --profiles both set the client budgets; pass one of them")
    if budgets is not None:
        return cycled_budgets(budgets, clients)
    if profiles is not None:
        from feast_edge.budget.profile import budgets_from_profiles
        from feast_edge.space.preset import load_preset

        return budgets_from_profiles(parse_list(profiles), clients, load_preset(preset))
    return None


_HELP, _BOUNDS, _DEFAULTS = (
    help_of(SimulationConfig, "simulation"),
    bounds_of(SimulationConfig),
    defaults(SimulationConfig),
)


def _setting(key: str, kind: Any, *names: str) -> tuple[Any, Any, Any]:
    """The option (type, default, typer's option) of setting ``key``, read as ``kind`` (``names``: where not
    ``--key``): its declared default, help and bounds."""
    default = Path(_DEFAULTS[key]) if kind is Path else _DEFAULTS[key]
    option = typer.Option(*(names or (f"--{key.replace('_', '-')}",)), help=_HELP[key], **_BOUNDS.get(key, {}))
    return kind, default, option


_POPULATION_OPTIONS = {
    "preset": _setting("preset", str, "--preset", "-p"),
    "dataset": _setting("dataset", str),
    "data": _setting("data_dir", Path, "--data"),
    "clients": _setting("clients", int),
    "budgets": (
        Optional[str],
        None,
        typer.Option(
            "--budgets",
            help="Explicit client budgets instead of Zipf, comma-separated (e.g. a device-profile mix: 2.79M,6.6M,17.67M); cycled over --clients.",
        ),
    ),
    "profiles": (
        Optional[str],
        None,
        typer.Option(
            "--profiles",
            help="Client budgets from device profiles instead of Zipf, comma-separated names in profiles/ or .json files; cycled over --clients.",
        ),
    ),
    "gamma": _setting("gamma", float),
    "zipf_s": _setting("zipf_s", float),
    "alpha_eff": _setting("alpha_eff", float),
    "budget_min": _setting("budget_min", Optional[str]),  # MACs as text (parse_macs)
    "budget_max": _setting("budget_max", Optional[str]),
    "budget_cap": _setting("budget_cap", Optional[str]),
    "seed": _setting("seed", int),
    "val_samples": _setting("val_samples", int),
    "calib_samples": _setting("calib_samples", int),
    "train_limit": _setting("train_limit", Optional[int]),
    "cache": _setting("cache", Optional[Path]),
}
# The settings these options give (--data: data_dir; --budgets or --profiles: budgets).
POPULATION_KEYS = frozenset({*_POPULATION_OPTIONS, "data_dir"} - {"data", "profiles"})


def _population(values: dict[str, Any]) -> dict[str, Any]:
    """The population options as keyword arguments of ``feast_edge.sim.simulate.SimulationConfig``."""
    macs = {
        name: None if values[name] is None else parse_macs(values[name])
        for name in ("budget_min", "budget_max", "budget_cap")
    }
    budgets = population_budgets(values["budgets"], values["profiles"], values["clients"], values["preset"])
    plain = {k: v for k, v in values.items() if k not in macs and k not in ("data", "budgets", "profiles", "cache")}
    cache = None if values["cache"] is None else str(values["cache"])
    return {**plain, **macs, "data_dir": str(values["data"]), "budgets": budgets, "cache": cache}


def population_options(func: F) -> F:
    """Give a typer command the data and population options; it receives them as ``population``, keyword arguments of SimulationConfig."""
    return option_group("population", _POPULATION_OPTIONS, _population)(func)
