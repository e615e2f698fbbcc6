"""Who trains in round ``t`` and with which seed (method §4): pure functions of ``(seed, t)`` and the client id.

Every random choice of a round derives from ``(seed, t)`` and the client id,
never from hidden state, so a resumed run and a distributed run draw the same
numbers as one uninterrupted in-process run.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

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
