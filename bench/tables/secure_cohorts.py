"""The tables of ``bench/bench_secure_cohorts.py``'s record (secure-cohorts), for docs/benchmarks.md.

"six-devices" and "zipf": before (the uniform draw, uncapped plans, the largest affordable variant served) against
after (the stratified draw, plans capped at what the round reveals), a column each.
"""

from __future__ import annotations

from _tables import Column, Table, macs, number_range, percent

RECORDS = ("secure-cohorts",)
SIDES = ("before", "after")


def _sides(part: str):
    """The rows of a transposed table: (side, its figures) for ``figures[part]``."""
    return lambda figures: ((side, figures[part][side]) for side in SIDES)


def _tiers(side: dict) -> list[list[dict]]:
    """The clients grouped by budget, in the record's order."""
    tiers: dict[float, list[dict]] = {}
    for client in side["clients"]:
        tiers.setdefault(client["budget_macs"], []).append(client)
    return list(tiers.values())


def _per_tier(side: dict, words) -> str:
    """``words(clients of one budget)`` for each budget, joined by ``/``."""
    return " / ".join(words(clients) for clients in _tiers(side))


def _one_or_all(values: list) -> str:
    """The clients of one budget alike: their one value; else each value once."""
    distinct = list(dict.fromkeys(values))
    return ", ".join(map(str, distinct))


def _served(clients: list[dict]) -> str:
    variants = _one_or_all([c["served"] for c in clients])
    return variants + (" (never-updated slices)" if any(c["served_never_updated"] for c in clients) else "")


def _accuracies(key: str):
    """Per budget, the clients' test accuracy under ``key``: ``43.50 / 44.50 / 58.60 %``."""
    return lambda side: _per_tier(side, lambda clients: _one_or_all([f"{100 * c[key]:.2f}" for c in clients])) + " %"


def _best_trained(side: dict) -> str:
    """Per budget, the best affordable variant whose every slice trained, then its test accuracy."""
    variants = _per_tier(side, lambda clients: _one_or_all([c["best_trained"] for c in clients]))
    return f"{variants}: {_accuracies('best_trained_test_accuracy')(side)}"


def _withheld(rounds: list[list[str]]) -> str:
    """Which segments were withheld (named by the clients they were routed to), in how many rounds."""
    counts: dict[str, int] = {}
    for withheld in rounds:
        for segment in withheld:
            counts[segment] = counts.get(segment, 0) + 1
    return "; ".join(f"{segment}: {n} of {len(rounds)} rounds" for segment, n in counts.items()) or "none"


def _six_names(figures: dict) -> dict[str, str]:
    budgets = dict.fromkeys(figures["six_devices"]["budgets"])
    return {"budgets": " / ".join(macs(b) for b in budgets)}


def _zipf_sides(figures: dict):
    """The Zipf fleet's sides, each with the largest per-client inclusion probability of its draw."""
    zipf = figures["zipf"]
    before = {**zipf["before"], "inclusion": (zipf["uniform_inclusion"], "m / N")}
    after = {**zipf["after"], "inclusion": (zipf["largest_inclusion"], f"a top tier of {zipf['tiers'][-1]}")}
    return (("before", before), ("after", after))


def _capped(rounds: list[int]) -> str:
    return f"{sum(rounds)} in {len(rounds)} rounds"


TABLES = {
    "six-devices": Table(
        label="",
        rows=_sides("six_devices"),
        names=_six_names,
        transposed=True,
        columns=(
            Column("segments withheld (the clients they were routed to)", lambda s: s["withheld_per_round"], _withheld),
            Column("members routed less than their affordable set", lambda s: s["capped_members_per_round"], _capped),
            Column("variants whose every slice trained", lambda s: s["trained_variants"], number_range),
            Column("served variant, {budgets} clients", lambda s: _per_tier(s, _served)),
            Column("served test accuracy, {budgets}", _accuracies("served_test_accuracy")),
            Column("best affordable variant whose slices all trained: its test accuracy", _best_trained),
            Column("population accuracy (mean of the served)", lambda s: s["population_accuracy"], percent),
        ),
    ),
    "zipf": Table(
        label="",
        rows=_zipf_sides,
        transposed=True,
        columns=(
            Column(
                "withheld segments per round (mean, max)",
                lambda s: f"{s['mean_withheld']:.2f}, {max(s['withheld_per_round'])}",
            ),
            Column(
                "rounds with a segment withheld",
                lambda s: f"{s['rounds_with_any_withheld']} of {len(s['withheld_per_round'])}",
            ),
            Column("members routed less than their affordable set", lambda s: s["capped_members_per_round"], _capped),
            Column(
                "largest per-client inclusion probability",
                lambda s: s["inclusion"],
                lambda inclusion: f"{inclusion[0]:.3f} ({inclusion[1]})",
            ),
        ),
    ),
}
