"""The settings of buffered asynchronous rounds (feast_edge.run.asynchronous): K updates per release, M devices
training at once, S releases of staleness at most, the discount s(τ) of a stale update's weight, and the server's step
η of a release by plain averaging."""

from __future__ import annotations

import math
from dataclasses import dataclass

from feast_edge.settings.validated import RunError

DISCOUNTS = ("sqrt", "constant", "hinge", "inverse")
HINGE = 2  # hinge: no discount up to this staleness
# η of a release by plain averaging unless --server-lr says otherwise: θ[u] += η · (the buffer's weighted mean - θ[u]).
# η = 1 left the straggler fleet near chance; 0.25 trained it (docs/benchmarks.md, "Asynchronous rounds").
SERVER_LR = 0.25


def discount(kind: str, tau: int) -> float:
    """s(τ): the weight of an update ``tau`` releases stale, relative to a fresh one (feast_edge.run.asynchronous, "release")."""
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    if kind == "constant":
        return 1.0
    if kind == "hinge":
        return 1.0 if tau <= HINGE else 1.0 / (1.0 + tau - HINGE)
    if kind == "inverse":  # FedAsync's polynomial discount (1 + τ)^-a with a = 1 (Xie et al., 2019)
        return 1.0 / (1.0 + tau)
    raise RunError(f"--staleness {kind!r} is not a staleness discount; choose one of {', '.join(DISCOUNTS)}")


@dataclass(frozen=True)
class AsyncSettings:
    """K, M, S and s(τ) of buffered asynchronous rounds."""

    buffer: int  # K: updates per release
    concurrency: int  # M: devices training at once
    max_staleness: int  # S: releases an update may lag behind
    staleness: str = "sqrt"

    def __post_init__(self) -> None:
        problems = [
            f"--buffer {self.buffer} must be at least 1" if self.buffer < 1 else "",
            f"--concurrency {self.concurrency} must be at least --buffer {self.buffer} (a release needs K updates "
            "in flight)"
            if self.concurrency < self.buffer
            else "",
            f"--max-staleness {self.max_staleness} must be at least 0" if self.max_staleness < 0 else "",
        ]
        problem = next((p for p in problems if p), "")
        if problem:
            raise RunError(problem)
        discount(self.staleness, 0)
