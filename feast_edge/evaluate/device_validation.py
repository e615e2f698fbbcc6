"""One round's validation by the devices, as a record: what ``feast-server`` (over MQTT) and ``feast-edge simulate
--validate-on devices`` (in process) both compute from the devices' (correct, total) counts.

    targets          the probes (the round's figure) and the variants the devices are served, by MACs
    reports          device -> (correct, total) per target, (0, 0) where it did not test it
    device_record()  the round's figure (robust_validation of the probes), every target's point, the flags (with the
                     class mixes that may explain them) and each device's figures on its served variant, which vote
                     on the served round (feast_edge.evaluate.served_round)
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from feast_edge.cache.variants import CacheEntry, VariantCache
from feast_edge.evaluate.federated import Validated, combine_counts, robust_validation


def validation_targets(
    cache: VariantCache,
    probes: Sequence[CacheEntry],
    budgets: Iterable[float],
    limit: int | None = None,
    trained: Collection[int] | None = None,
) -> list[CacheEntry]:
    """The probes and the variants served at ``budgets`` (each device's largest affordable, or, given ``trained``,
    its largest affordable whose every slice a release moved: secure aggregation), by MACs; the served ones beyond
    ``limit`` targets in all (a request's bound on the wire) are left out, the largest kept."""
    servable = [cache.servable(b, trained) for b in budgets if cache.affordable(b)]
    served = {entries[-1] for entries in servable if entries}
    extra = sorted(served - set(probes), key=lambda e: e.macs, reverse=True)
    kept = extra if limit is None else extra[: max(0, limit - len(probes))]
    return sorted([*probes, *kept], key=lambda e: e.macs)


def device_record(
    reports: Mapping[str, Sequence[tuple[int, int]]],
    targets: Sequence[CacheEntry],
    probes: Sequence[CacheEntry],
    cache: VariantCache,
    served: Mapping[str, CacheEntry],
    mixes: Mapping[str, Sequence[int]],
    rule: str,
    max_weight_ratio: float,
) -> tuple[Validated, dict[str, Any]]:
    """The round's figure and its ``RoundRecord.validation`` (source "devices"; the caller adds "missing", "seconds").

    ``served``: device -> the variant it is served; ``mixes``: device -> its held-out examples per class.
    """
    base = [k for k, e in enumerate(targets) if e in probes]
    result = robust_validation(
        {d: [c[k] for k in base] for d, c in reports.items()}, len(base), rule, max_weight_ratio, mixes
    )
    every = robust_validation(reports, len(targets), rule, max_weight_ratio)
    combined = combine_counts(reports.values(), len(targets))
    labels = [f"variant {cache.entries.index(e)}" for e in targets]
    figures = {}
    for device, counts in sorted(reports.items()):
        entry = served.get(device)
        if entry in targets and counts[targets.index(entry)][1] > 0:
            k = targets.index(entry)
            figures[device] = [labels[k], *counts[k]]
    record = {
        "source": "devices",
        "rule": rule,
        "devices": sorted(reports),
        "samples": max((n for _, n in combined), default=0),
        "points": {label: p for label, p in zip(labels, every.points) if p is not None},
        # Per target, the held-out examples behind its point (the serving rule's standard errors) and the devices
        # whose held-out split tested it (the classes its validation covered).
        "examples": {label: n for label, (_, n) in zip(labels, combined)},
        "tested_by": {label: sorted(d for d, c in reports.items() if c[k][1] > 0) for k, label in enumerate(labels)},
        "flagged": dict(sorted(result.flagged.items())),
        "differs": dict(sorted(result.differs.items())),
        # Each device's result on the variant it is served (its largest affordable): its vote on the served round.
        "served": figures,
    }
    return result, record
