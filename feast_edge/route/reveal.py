"""What secure aggregation can reveal of a fleet's routed slices (docs/security.md §10; method §5).

FEAST's envelopes nest: a device is routed the envelope of a prefix of the MAC-sorted cache (method §5), so a fleet's
devices fall into *tiers*, the distinct routed layouts, smallest first, each inside the next. A round's segments (the
positions routed to the same devices, feast_edge.aggregate.segments) are then the shells between the tiers present in
its cohort, and the shell of tier k is trained by every cohort device of tier k or above. Secure aggregation reveals a
segment's sum only over at least ``least`` = c + 2 devices, so a slice trained by fewer is never released:

    cap(tiers)        the highest tier that at least ``least`` of the devices reach (None: fewer devices): over the
                      fleet, what can ever be revealed; over a cohort, what that round reveals
    capped(plan, k)   the plan cut to the variants inside tier k's layout: its device is routed, and trains, only
                      what can be revealed
    unrevealed(...)   the variants some device affords that fewer than ``least`` devices hold, and how many do
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from feast_edge.cache.variants import VariantCache
from feast_edge.route.envelope import Envelope
from feast_edge.route.plans import ClientPlan
from feast_edge.space.geometry import Layout, arch_layout
from feast_edge.space.preset import Preset


@dataclass(frozen=True)
class Unrevealed:
    """The variants (cache indices) that cannot be revealed over a fleet, each with how many devices hold it."""

    holders: Mapping[int, int]  # cache index -> devices whose routed envelope holds all of it (< least)
    cap: int | None  # the fleet's cap (a tier); None: fewer than ``least`` devices in all
    least: int

    def __bool__(self) -> bool:
        return bool(self.holders)


class Reveal:
    """The tiers of one cache and what ``least`` devices reveal of them (see the module docstring)."""

    def __init__(self, preset: Preset, cache: VariantCache, least: int) -> None:
        self.preset, self.cache, self.least = preset, cache, least
        classes = preset.classes
        self.index = {e.arch: i for i, e in enumerate(cache.entries)}
        self.layouts: list[Layout] = []  # the tiers' routed layouts, smallest first, each inside the next
        self.prefix_tier: list[int] = []  # cache index i -> the tier of a device whose largest affordable is i
        for i in range(len(cache)):
            layout = Envelope.of(e.arch for e in cache.entries[: i + 1]).layout(preset, classes)
            if not self.layouts or layout != self.layouts[-1]:
                self.layouts.append(layout)
            self.prefix_tier.append(len(self.layouts) - 1)
        # cache index -> the smallest tier whose layout holds the variant's every tensor (its leading slices)
        self.inside = [
            next(k for k, layout in enumerate(self.layouts) if arch_layout(preset, e.arch, classes).fits_in(layout))
            for e in cache.entries
        ]

    def tier(self, budget: float) -> int:
        """The tier a device of ``budget`` MACs is routed (CacheError below the smallest variant)."""
        return self.prefix_tier[self.index[self.cache.largest_affordable(budget).arch]]

    def cap(self, tiers: Iterable[int]) -> int | None:
        """The highest tier at least ``least`` of these devices (their tiers) reach; None: fewer devices."""
        ranked = sorted(tiers, reverse=True)
        return ranked[self.least - 1] if len(ranked) >= self.least else None

    def capped(self, plan: ClientPlan, cap: int) -> ClientPlan:
        """``plan`` cut to its variants inside tier ``cap``'s layout (the smallest variant always is), its envelope
        theirs; the plan itself when nothing is cut."""
        kept = tuple(a for a in plan.affordable if self.inside[self.index[a]] <= cap)
        return plan if len(kept) == len(plan.affordable) else ClientPlan(kept, plan.global_min, Envelope.of(kept))

    def unrevealed(self, budgets: Iterable[float]) -> Unrevealed:
        """The variants some device of ``budgets`` affords that fewer than ``least`` of them hold."""
        budgets = list(budgets)
        tiers = [self.tier(b) for b in budgets]
        top = max((self.index[self.cache.largest_affordable(b).arch] for b in budgets), default=-1)
        holders = {i: sum(t >= self.inside[i] for t in tiers) for i in range(top + 1)}
        return Unrevealed({i: n for i, n in holders.items() if n < self.least}, self.cap(tiers), self.least)

    def words(self, unrevealed: Unrevealed) -> str:
        """One line for people: which variants cannot be revealed, why, and what to change."""
        entries = self.cache.entries
        macs = [e.macs for e in entries]
        if not unrevealed:
            return (
                f"--secure-agg: every variant the devices afford can be revealed (each is held by at least "
                f"--colluders + 2 = {self.least} devices)"
            )
        groups: dict[int, list[int]] = {}
        for i, n in sorted(unrevealed.holders.items()):
            groups.setdefault(n, []).append(i)
        if len(groups) == 1:
            ((n, _),) = groups.items()
            them = "it" if len(unrevealed.holders) == 1 else "them"
            why = f"only {n} device{' affords' if n == 1 else 's afford'} {them}"
        else:
            why = "only " + " and ".join(
                f"{n} device{' affords' if n == 1 else 's afford'} {_variants(indices, macs, bare=True)}"
                for n, indices in sorted(groups.items(), reverse=True)
            )
        if unrevealed.cap is None:
            served = "no variant can be revealed"
        else:
            largest = max(i for i, k in enumerate(self.inside) if k <= unrevealed.cap)
            served = f"the devices that afford them train and are served variants up to {macs[largest] / 1e6:.2f}M MACs"
        return (
            f"--secure-agg: {_variants(sorted(unrevealed.holders), macs)} cannot be revealed: {why}, and a sum is "
            f"revealed over at least --colluders + 2 = {self.least} devices; {served}. Add devices with budgets of at "
            f"least {macs[min(unrevealed.holders)] / 1e6:.2f}M MACs, or lower --colluders"
        )


def _variants(indices: list[int], macs: list[int], bare: bool = False) -> str:
    """``variant 12 (21.48M MACs)`` or ``variants 12-13 (21.48M-22.91M MACs)`` (runs of indices); ``bare``: without the
    MACs."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    said = [
        (f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}")
        + (
            ""
            if bare
            else f" ({macs[r[0]] / 1e6:.2f}M MACs)"
            if len(r) == 1
            else f" ({macs[r[0]] / 1e6:.2f}M-{macs[r[-1]] / 1e6:.2f}M MACs)"
        )
        for r in runs
    ]
    return f"variant{'s' if len(indices) > 1 else ''} {', '.join(said)}"
