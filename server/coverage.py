"""The fleet's class coverage as the server sees it: from the registry's per-class counts, warned about once.

The computation is ``feast_edge.evaluate.coverage``; this module reads the registry, says each new problem once in
one line (at the first round, when a device that changes the picture registers, and again under the final table),
and gives each served variant's coverage for the manifests that ``status``, the dashboard and ``report`` show.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.coverage import (
    LARGEST_BY_SETTING,
    Holder,
    Serving,
    coverage_warnings,
    holder_of,
    serving_choice,
    variant_coverage,
)
from feast_edge.server.registry import Device, Registry

log = logging.getLogger(__name__)

TRAINED = "--secure-agg withholds a slice fewer than --colluders + 2 devices trained"


def holders(devices: Iterable[Device]) -> list[Holder]:
    """Every registered device's budget, evaluation limit and per-class counts."""
    return [holder_of(d.device_id, d.budget_macs, d.profile) for d in devices]


def served_macs(cache: VariantCache, fleet: Sequence[Holder]) -> list[int]:
    """The MACs of the variants the fleet is served by the largest-affordable rule (sorted, distinct)."""
    return sorted({cache.largest_affordable(h.budget_macs).macs for h in fleet if cache.affordable(h.budget_macs)})


class CoverageWatch:
    """Logs each coverage problem of the registered fleet once (a warning per line)."""

    def __init__(self, registry: Registry, cache: VariantCache, class_names: Sequence[str]) -> None:
        self.registry, self.cache, self.names = registry, cache, tuple(class_names)
        self.said: set[str] = set()

    def lines(self) -> list[str]:
        fleet = holders(self.registry.devices())
        return coverage_warnings(fleet, served_macs(self.cache, fleet), self.names)

    def check(self) -> list[str]:
        """Warn about the problems not said before; returns every current one."""
        current = self.lines()
        for line in current:
            if line not in self.said:
                self.said.add(line)
                log.warning("class coverage: %s", line)
        return current


def manifest_coverage(
    devices: Sequence[Device],
    macs: int,
    class_names: Sequence[str],
    calibrated_by: Sequence[str] | None = None,
) -> dict[str, object]:
    """One served variant's coverage for its manifests (JSON): trained, validated and calibrated classes."""
    cov = variant_coverage(holders(devices), macs, len(class_names), calibrated_by)
    return cov.to_dict(class_names)


def validation_points(points: Mapping[str, float], cache: VariantCache) -> dict[int, float]:
    """A validation record's points (``"variant i"`` -> accuracy) by cache index."""
    out = {}
    for label, accuracy in points.items():
        head, _, index = label.partition(" ")
        if head == "variant" and index.isdigit() and int(index) < len(cache.entries) and accuracy is not None:
            out[int(index)] = float(accuracy)
    return out


def serving_plan(
    cache: VariantCache,
    devices: Sequence[Device],
    points: Mapping[int, float],
    examples: Mapping[int, int] | None = None,
    rule: str = "validated",
    trained: Collection[int] | None = None,
) -> dict[str, Serving]:
    """Each device's served variant by the serving ``rule``: "validated" (feast_edge.evaluate.coverage.serving_choice
    over the validation ``points``, cache index -> accuracy, on ``examples`` held-out examples each) or "largest";
    given ``trained`` (--secure-agg: the variants whose every slice a release moved), among those only."""
    plans = {}
    for d in devices:
        servable = cache.servable(d.budget_macs, trained)
        if not servable:
            cache.largest_servable(d.budget_macs, trained)  # raises the error that names the fix
        affordable = [(cache.entries.index(e), e.macs) for e in servable]
        if rule == "largest":
            index, macs = affordable[-1]
            chosen = Serving(index, macs, LARGEST_BY_SETTING, macs, points.get(index))
        else:
            chosen = serving_choice(affordable, points, examples)
        top = cache.largest_affordable(d.budget_macs).macs
        if top != affordable[-1][1]:  # its largest affordable variant holds slices no release moved
            chosen = replace(chosen, rule=f"{chosen.rule}, of the variants whose every slice trained ({TRAINED})",
                             largest_macs=top)  # fmt: skip
        plans[d.device_id] = chosen
    return plans
