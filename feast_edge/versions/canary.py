"""Canary, then everyone: a new version goes first to a canary set drawn across budget tiers, and to every other
device only if the canaries do not regress.

    tiers        the devices' budgets in TIERS groups of near-equal size by rank (equal budgets share a tier)
    canaries     max(one per tier present, ceil(share x devices)): one seeded draw in each tier first, the rest
                 from all the others; share 0: no canaries, every device is offered the version at once
    voters       canaries that compared the version with the one they run, less the devices the served-round rule
                 distrusts (feast_edge.evaluate.served_round)
    d_i          voter i's paired difference, new minus old accuracy on its held-out split; with three or more
                 voters each d_i is clipped to the range of the others' (feast_edge.evaluate.candidates), so one
                 lying canary can neither hold a version back nor promote one alone
    regressed    voters whose clipped -d_i exceeds their own install threshold (the gate's rule, gate.py)
    promoted     unless more than half of the voters regressed (the served-round rule's majority); no voter: promoted
                 when the canaries have had their time (they installed a first model, or did not answer)

A device that runs no model yet is offered the newest version at once, whatever its state (it has nothing to regress
from). Pure functions, so a restarted server decides the same from its registry.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from feast_edge.evaluate.candidates import clipped_differences
from feast_edge.versions.gate import Verdict

TIERS = 4  # budget tiers a canary set covers
DEFAULT_SHARE = 0.2  # --canary: the share of the devices a version goes to first


def budget_tiers(budgets: Mapping[str, int], tiers: int = TIERS) -> dict[str, int]:
    """Each device's tier, 0 (smallest budgets) to ``tiers - 1``: by rank, devices of equal budget in one tier."""
    order = sorted(budgets, key=lambda d: (budgets[d], d))
    out: dict[str, int] = {}
    first: dict[int, int] = {}  # budget -> the tier of its first device
    for rank, device in enumerate(order):
        out[device] = first.setdefault(budgets[device], rank * tiers // max(1, len(order)))
    return out


def draw_canaries(budgets: Mapping[str, int], share: float, seed: int, version: int) -> tuple[str, ...]:
    """The canary set of ``version`` among ``budgets``' devices (see the module docstring), sorted; the draw is a
    function of (seed, version), so a restarted server draws the same."""
    if not 0 <= share <= 1:
        raise ValueError(f"--canary must be a share in [0, 1], got {share}")
    if share == 0 or not budgets:
        return ()
    tiers = budget_tiers(budgets)
    rng = np.random.default_rng([seed, version, 0xCA7A])
    chosen: list[str] = []
    for tier in sorted(set(tiers.values())):
        members = sorted(d for d, t in tiers.items() if t == tier)
        chosen.append(members[int(rng.integers(len(members)))])
    rest = sorted(set(budgets) - set(chosen))
    more = max(0, math.ceil(share * len(budgets) - 1e-9) - len(chosen))
    if more and rest:
        chosen += [rest[i] for i in rng.permutation(len(rest))[:more]]
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class Promotion:
    """Whether a version goes to everyone, why, and which canaries regressed."""

    promote: bool
    reason: str
    voters: tuple[str, ...] = ()
    regressed: tuple[str, ...] = ()


def judge_canaries(reports: Mapping[str, Verdict], distrusted: Collection[str] = ()) -> Promotion:
    """Promote or hold a version from its canaries' verdicts (see the module docstring)."""
    voters = tuple(sorted(d for d, v in reports.items() if v.examples and d not in distrusted))
    if not voters:
        return Promotion(True, f"no canary compared it with a model it runs ({len(reports)} answered)")
    differences = {d: reports[d].difference or 0.0 for d in voters}
    clipped = clipped_differences(differences)
    regressed = tuple(d for d in voters if -clipped[d] > reports[d].threshold)  # what the decision counts
    own = [d for d in voters if -differences[d] > reports[d].threshold]  # what each canary's own figures say
    falls = ", ".join(
        f"{d} {100 * (reports[d].old_accuracy or 0):.1f}% -> {100 * (reports[d].new_accuracy or 0):.1f}%" for d in own
    )
    moved = sorted(d for d in voters if (d in regressed) != (d in own))
    bounded = f"; {', '.join(moved)}'s figures bounded by the others' (one device alone cannot decide)" if moved else ""
    if 2 * len(regressed) > len(voters):
        return Promotion(
            False,
            f"held back: it regressed on {len(own)} of {len(voters)} canaries ({falls}){bounded}",
            voters,
            regressed,
        )
    some = f"; regressed on {len(own)} only ({falls})" if own else ""
    return Promotion(
        True, f"promoted: no significant regression on {len(voters)} canaries{some}{bounded}", voters, regressed
    )
