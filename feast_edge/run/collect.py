"""What the run loop asks of "how a cohort's updates are collected", the one part simulation and deployment do differently.

In process (``feast_edge.sim.setup.InProcessCollector``: the harness trains each
member) or over MQTT (``feast_edge.server.collect``: the devices train); both
return the round's valid updates as :class:`ClientUpdate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from feast_edge.aggregate.segments import SegmentSums
from feast_edge.route.plans import ClientPlan

# The kinds of a refused update a run counts (Collected.refusals, RoundRecord.refusals): too stale to release
# (asynchronous rounds, --max-staleness); any other refusal is counted as REFUSED.
STALE, REFUSED = "stale", "refused"


@dataclass
class ClientUpdate:
    """One valid update a collector gathered: the trained slice and what the client reported."""

    client: str
    state: dict[str, torch.Tensor]
    samples: int  # n_i, the aggregation weight
    loss: float | None = None
    samples_seen: float = 0.0
    train_macs: int = 0
    compute_seconds: float | None = None
    variants_per_batch: Mapping[str, int] = field(default_factory=dict)
    self_reported: bool = False  # ``samples`` is the client's claim, not a count the server knows (weight-capped)


@dataclass
class Collected:
    """What collecting one round's cohort produced: the valid updates, or, from a collector that never hands over a
    single update, their per-segment sums (feast_edge.aggregate.segments) with ``updates`` holding only what each
    contributor reported (its ``state`` empty)."""

    updates: list[ClientUpdate]
    rejected: dict[str, str] = field(default_factory=dict)  # client -> why what it sent is refused
    declined: dict[str, str] = field(default_factory=dict)  # client -> why it said no update will come
    incomplete: dict[str, str] = field(default_factory=dict)  # client -> what did not get through (payload or upload)
    missing: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    send_seconds: float = 0.0
    sums: SegmentSums | None = None
    clock: float | None = None  # seconds since the run began when this input was complete (a virtual clock's)
    staleness: dict[str, int] = field(default_factory=dict)  # client -> releases since the version it trained from
    durations: dict[str, float] = field(default_factory=dict)  # client -> its job's seconds on the clock
    withheld: dict[str, str] = field(default_factory=dict)  # secure sums: segment members -> why it kept θ_t
    refusals: dict[str, str] = field(default_factory=dict)  # client in ``rejected`` -> the refusal's kind (STALE)


class Wrapped:
    """A collector around ``inner``: the same clients and budgets; a subclass gives its own ``collect``."""

    def __init__(self, inner: Collector) -> None:
        self.inner = inner

    def clients(self, needed: int) -> list[str]:
        return self.inner.clients(needed)

    def fleet(self) -> list[str]:
        return self.inner.fleet()

    def budget(self, client: str) -> float:
        return self.inner.budget(client)


class Collector(Protocol):
    """How a cohort's updates are collected: in process (simulation) or over MQTT (deployment)."""

    def clients(self, needed: int) -> list[str]:
        """The clients a cohort may be drawn from, once at least ``needed`` are available."""

    def fleet(self) -> list[str]:
        """Every client of the federation, available or not (a server's registered devices)."""

    def budget(self, client: str) -> float:
        """The client's MAC budget."""

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, ClientPlan],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        """Round ``t``: route each cohort member its plan's slice of ``global_state``, return the valid updates."""
