"""The data and population options of ``feast-edge simulate`` and ``partition`` (method §4): clients, budgets, γ, the data set."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from feast_edge.cli.common import F, option_group, parse_list, parse_macs
from feast_edge.errors import FeastError


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


_POPULATION_OPTIONS = {
    "preset": (str, "fmnist-small", typer.Option("--preset", "-p", help="Preset name or .toml file.")),
    "dataset": (
        str,
        "fashion-mnist",
        typer.Option(
            "--dataset",
            help="fashion-mnist, cifar10, cifar100 (binary release) or imagefolder (--data/train/<class name>/*, "
            "--data/test/<class name>/*, labelled by the preset's class names).",
        ),
    ),
    "data": (
        Path,
        Path("/usr/share/datasets/fashion-mnist"),
        typer.Option("--data", help="Local data directory (never downloaded)."),
    ),
    "clients": (int, 20, typer.Option("--clients", help="Number of clients N.")),
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
    "gamma": (
        float,
        1.0,
        typer.Option("--gamma", help="Allocation exponent γ (0: data independent of budget, 1: proportional)."),
    ),
    "zipf_s": (float, 1.2, typer.Option("--zipf-s", help="Zipf exponent of the budget ranks.")),
    "alpha_eff": (float, 0.45, typer.Option("--alpha-eff", help="Effective Dirichlet concentration α_eff.")),
    "budget_min": (
        Optional[str],
        None,
        typer.Option("--budget-min", help="Smallest Zipf budget (MACs, e.g. 1.5M); default from the preset."),
    ),
    "budget_max": (
        Optional[str],
        None,
        typer.Option("--budget-max", help="Largest Zipf budget (MACs); default from the preset."),
    ),
    "budget_cap": (
        Optional[str],
        None,
        typer.Option("--budget-cap", help="Allocation cap B_cap (MACs); default from the preset."),
    ),
    "seed": (
        int,
        0,
        typer.Option(
            "--seed", help="Seed of every random choice: split, budgets, partition (and training in simulate)."
        ),
    ),
    "val_samples": (int, 5000, typer.Option("--val-samples", help="Server-held validation samples.")),
    "calib_samples": (int, 500, typer.Option("--calib-samples", help="Server-held BN-calibration samples.")),
    "train_limit": (
        Optional[int],
        None,
        typer.Option("--train-limit", help="Use only this many training examples for clients."),
    ),
    "cache": (
        Optional[Path],
        None,
        typer.Option(
            "--cache", help="Variant cache JSON (default: the one beside the preset's file, else the shipped one)."
        ),
    ),
}


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
