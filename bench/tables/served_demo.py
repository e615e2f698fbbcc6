"""The tables of ``bench/bench_served_demo.py``'s record (served-demo), for docs/benchmarks.md.

"devices": per demo device, its served variant's test accuracy from the last round's own weights, from the two tail
means and from what the run serves, then what the second candidate costs it.
"""

from __future__ import annotations

import statistics

from _tables import Column, Table, megabytes, percent, points, seconds

RECORDS = ("served-demo",)


def _means(device: dict) -> list[float]:
    """The device's accuracies from the tail means, in the record's order: the window that fits the run, then the
    last 5 rounds' (the window before it fit the run)."""
    return [accuracy for name, accuracy in device["test"].items() if name.startswith("mean ")]


def _names(figures: dict) -> dict[str, str]:
    """The last round and the two windows, for the headers: "mean 5-6" -> "5–6"."""
    first = next(iter(figures["devices"].values()))["test"]
    windows = [name.removeprefix("mean ").replace("-", "\N{EN DASH}") for name in first if name.startswith("mean ")]
    return {"last": figures["rounds"], "fit": windows[0], "old": windows[-1]}


def _validations(device: dict) -> tuple[list[float], list[float]]:
    return device["validation_seconds_one"], device["validation_seconds_two"]


def _medians(one_and_two: tuple[list[float], list[float]]) -> str:
    """The median validation with one candidate and with two, in the agents' logs: ``9.15 / 20.60 s``."""
    return " / ".join(f"{statistics.median(s):.2f}" if s else "\N{EN DASH}" for s in one_and_two) + " s"


TABLES = {
    "devices": Table(
        label="device",
        rows=lambda figures: figures["devices"].items(),
        names=_names,
        columns=(
            Column("round {last}'s own", lambda d: d["test"]["own"], percent),
            Column("mean of rounds {fit}", lambda d: _means(d)[0], percent),
            Column("mean of rounds {old} (before)", lambda d: _means(d)[-1], percent),
            Column("served", lambda d: d["test"]["served"], percent),
            Column("served − own (points)", lambda d: d["served_minus_own"], points),
            Column("one more candidate: its payload", lambda d: d["second_candidate_bytes"], megabytes),
            Column("its evaluation", lambda d: d["evaluation_seconds"], seconds),
            Column("validation in the run, one / two candidates", _validations, _medians),
        ),
    )
}
