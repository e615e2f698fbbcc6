"""Who trains in round ``t`` and with which seed (method §4): pure functions of ``(seed, t)`` and the client id.

Every random choice of a round derives from ``(seed, t)`` and the client id,
never from hidden state, so a resumed run and a distributed run draw the same
numbers as one uninterrupted in-process run.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from feast_edge.errors import FeastError

# Stream tags keep the random streams of one round independent of each other.
_COHORT, _CLIENT = 1, 2


class CohortError(FeastError, ValueError):
    """A cohort cannot be drawn with the given sizes."""


def round_rng(seed: int, round_index: int) -> np.random.Generator:
    """The generator that draws round ``round_index``'s cohort."""
    return np.random.default_rng([seed, round_index, _COHORT])


def client_seed(seed: int, round_index: int, client_id: str) -> int:
    """Seed of one client's local training in one round (stable across processes and machines)."""
    key = zlib.crc32(client_id.encode("utf-8"))
    return int(np.random.SeedSequence([seed, round_index, _CLIENT, key]).generate_state(1, dtype=np.uint64)[0] >> 1)


def sample_cohort(n_clients: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """``m`` client ids drawn uniformly without replacement for one round, sorted (method §4)."""
    if not 1 <= m <= n_clients:
        raise CohortError(f"cohort size m = {m} must be between 1 and the number of clients ({n_clients}); lower m")
    cohort = np.sort(rng.choice(n_clients, size=m, replace=False))
    cohort.flags.writeable = False
    return cohort


def sample_round_cohort(client_ids: Sequence[str], m: int, seed: int, round_index: int) -> list[str]:
    """``m`` of the given clients, uniformly without replacement, sorted (method §4)."""
    ids = sorted(client_ids)
    picked = sample_cohort(len(ids), m, round_rng(seed, round_index))
    return [ids[i] for i in picked]


def stratified_cohort(
    client_ids: Sequence[str], tiers: Mapping[str, int], m: int, least: int, seed: int, round_index: int
) -> list[str]:
    """``m`` of the given clients for a secure round, sorted: the uniform draw of :func:`sample_round_cohort` (the
    same generator), then, where the highest tier drawn has fewer than ``least`` members (``tiers``: client -> its
    budget tier, feast_edge.route.reveal), that tier raised to ``least`` with clients of it not drawn, swapping out
    members of the largest lower tiers. A tier that cannot be raised (too few clients of it, or too few members below
    it within m) is passed over for the next one down: the round's cap routes its members only what that tier's
    ``least`` reveal (docs/security.md §10). At most one tier is raised, so every segment a round routes has ``least``
    members or more whenever m >= least."""
    ids = sorted(client_ids)
    rng = round_rng(seed, round_index)
    drawn = [ids[i] for i in sample_cohort(len(ids), m, rng)]
    above = 0
    for level in sorted({tiers[c] for c in drawn}, reverse=True):
        count = above + sum(tiers[c] == level for c in drawn)
        if count >= least:
            break
        need = least - count
        pool = [c for c in ids if tiers[c] == level and c not in drawn]
        if len(pool) >= need and m - count >= need:
            added = [pool[i] for i in rng.choice(len(pool), need, replace=False)]
            removed: list[str] = []
            for lower in sorted({tiers[c] for c in drawn if tiers[c] < level}, reverse=True):
                members = [c for c in drawn if tiers[c] == lower]
                take = min(need - len(removed), len(members))
                removed += [members[i] for i in rng.choice(len(members), take, replace=False)]
                if len(removed) == need:
                    break
            return sorted({*drawn, *added} - set(removed))
        above = count
    return drawn


def inclusion(sizes: Sequence[int], m: int, least: int) -> list[float]:
    """Each tier's probability that one of its clients is in a :func:`stratified_cohort` of ``m``, for tiers of
    ``sizes`` clients (ascending tiers, every size > 0; docs/privacy.md).

    A tier's clients are exchangeable (drawn, added and swapped out uniformly), so a client of tier k is in the cohort
    with probability E[final members of k] / sizes[k]. The uniform draw's members per tier are multivariate
    hypergeometric, E = m · sizes[k] / N; the raise moves members by a rule that depends only on the counts of the
    tiers scanned from the top, so E[moved] is exact by conditioning tier by tier, from the top down (each tier's
    count given the draws left is hypergeometric), memoized on (tier, draws left, members above or still to
    remove)."""
    n_tiers, total = len(sizes), sum(sizes)
    within = [sum(sizes[: k + 1]) for k in range(n_tiers)]  # the clients of tier k or below
    zero = np.zeros(n_tiers)

    def hyper(k: int, r: int) -> list[tuple[int, float]]:
        """(a, P(a of tier k's clients among r drawn from the tiers up to k)), the a that can happen."""
        size, rest, ways = sizes[k], within[k] - sizes[k], math.comb(within[k], r)
        return [
            (a, math.comb(size, a) * math.comb(rest, r - a) / ways) for a in range(max(0, r - rest), min(size, r) + 1)
        ]

    @functools.cache
    def scan(k: int, r: int, above: int) -> np.ndarray:  # looking for the tier to raise, from tier k down
        moved = zero.copy()
        if k < 0 or r == 0:
            return moved
        for a, p in hyper(k, r):
            count = above + a
            if a and count >= least:
                continue
            if a == 0:
                moved += p * scan(k - 1, r, above)
                continue
            need = least - count
            if sizes[k] - a >= need and m - count >= need:
                step = zero.copy()
                step[k] = need
                moved += p * (step + swap(k - 1, r - a, need))
            else:
                moved += p * scan(k - 1, r - a, count)
        return moved

    @functools.cache
    def swap(k: int, r: int, need: int) -> np.ndarray:  # ``need`` members swapped out, from the largest lower tiers
        moved = zero.copy()
        if need == 0 or k < 0 or r == 0:
            return moved
        for a, p in hyper(k, r):
            took = min(a, need)
            step = zero.copy()
            step[k] = -took
            moved += p * (step + swap(k - 1, r - a, need - took))
        return moved

    expected = m * np.asarray(sizes, dtype=float) / total + scan(n_tiers - 1, m, 0)
    return [float(e / size) for e, size in zip(expected, sizes)]
