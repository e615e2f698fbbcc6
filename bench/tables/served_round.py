"""The tables of ``bench/bench_served_round.py``'s records (served-round-fmnist, served-round-digits), for
docs/benchmarks.md.

"candidates": per seed, what the devices' held-out data said of the last round's two candidates, and each device's
served test accuracy before the two candidates (the mean alone) and after. "liars": per liar and lie, over the seeds,
the served round, how far the honest devices' accuracy moved, and whether the liar was named and distrusted.
"""

from __future__ import annotations

from _tables import Column, Table, percent, signed

RECORDS = ("served-round-fmnist", "served-round-digits")
DEVICES = ("dev-a", "dev-b", "dev-c")  # the script's fleet: smallest, middle and largest cached variant


def _weights(name: str) -> str:
    """A record's name of served weights in words: "candidate" is the mean of the last rounds, else a round."""
    return "the mean" if name == "candidate" else f"round {name}'s own"


def _served_weights(result: dict) -> str:
    """The weights served before → after, as the devices of one seed were served them."""
    pairs = {(d["before_weights"], d["served_weights"]) for d in result["devices"].values()}
    return "; ".join(f"{_weights(before)} → {_weights(after)}" for before, after in sorted(pairs))


def _before_after(device: str) -> Column:
    """One device's served test accuracy before → after, and the difference in test images."""
    return Column(
        f"{device}: before → after (test images)",
        lambda result: (result["devices"][device], result["test_images"]),
        _change,
    )


def _change(device_and_images: tuple[dict, int]) -> str:
    device, images = device_and_images
    moved = round((device["served"] - device["before"]) * images)
    return f"{100 * device['before']:.2f} → {percent(device['served'])} ({signed(moved)})"


def _liar_runs(figures: dict) -> list[tuple[str, list[dict]]]:
    """(liar, lie) -> its run on every seed, in the record's order."""
    runs: dict[str, list[dict]] = {}
    for result in figures["results"]:
        for case in result["liars"]:
            runs.setdefault(f"{case['liar']}, {case['kind']}", []).append(case)
    return list(runs.items())


def _largest_change(cases: list[dict]) -> str:
    """The honest devices' largest move of served test accuracy against the honest run, in points."""
    moves = [abs(liar - honest) for case in cases for liar, honest in case["honest"].values()]
    return f"{100 * max(moves):.2f}"


def _first_named(cases: list[dict]) -> list[int | None]:
    """Per seed, the first round whose validation named the liar's report possibly false (None: never)."""
    return [case["liar_flagged"][0] if case["liar_flagged"] else None for case in cases]


def _distrusted(cases: list[dict]) -> list[int | None]:
    """Per seed, the round from which the liar was distrusted (None: never)."""
    return [case["distrusted"].get(case["liar"]) for case in cases]


def _honest_flagged(cases: list[dict]) -> str:
    return f"{sum(bool(case['honest_flagged']) for case in cases)} of {len(cases)}"


def _named(rounds: list[int | None]) -> str:
    """``2 of 3 (rounds 1, 11)``: in how many seeds it happened, and from which round."""
    found = [r for r in rounds if r is not None]
    return f"{len(found)} of {len(rounds)}" + (f" (rounds {', '.join(map(str, found))})" if found else "")


TABLES = {
    "candidates": Table(
        label="seed",
        rows=lambda figures: ((r["seed"], r) for r in figures["results"]),
        columns=(
            Column("step one: the devices' held-out figures, paired", lambda r: r["candidates"], align="left"),
            Column("served weights, before → after", _served_weights, align="left"),
            *(_before_after(device) for device in DEVICES),
        ),
    ),
    "liars": Table(
        label="liar, lie",
        rows=_liar_runs,
        columns=(
            Column("served round, per seed", lambda cases: ", ".join(str(c["served_round"]) for c in cases)),
            Column("honest devices' largest change (points)", lambda cases: cases, _largest_change),
            Column("liar named possibly false", _first_named, _named, align="left"),
            Column("liar distrusted", _distrusted, _named, align="left"),
            Column("an honest device flagged", _honest_flagged),
        ),
    ),
}
