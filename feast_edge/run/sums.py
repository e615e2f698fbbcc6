"""A collector whose rounds come back as per-segment sums (feast_edge.aggregate.segments), never as single updates:
one wrapper, :class:`Summed`, around any collector and a *sums transport* that says how the sums are made.

    open(t, cohort, plans, global_state)   before the cohort trains (over MQTT: the key stages start)
    inner.collect(...)                     the cohort's updates (masked ones, where the transport asked for them)
    sums(t, got, global_state)             the round's per-segment sums (in the clear, or masked and unmasked)
    close()                                always, however the round ended

:class:`ClearSums` makes them in the clear: the reference every secure transport must equal
(tests/core/test_segments.py). The secure ones mask in process (feast_edge.secagg.collector, ``feast-edge simulate
--secure-agg``) or over MQTT (feast_edge.server.secure, ``feast-server run --secure-agg``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from feast_edge.aggregate.checks import StateDict, check_payload
from feast_edge.aggregate.segments import plain_sums
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import Collected, Collector, Wrapped


class SumsTransport(Protocol):
    """How a round's valid updates become per-segment sums: in the clear, masked in process, or masked over MQTT."""

    def open(
        self, t: int, cohort: Sequence[str], plans: Mapping[str, ClientPlan], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        """Round ``t`` is about to be sent to ``cohort``."""

    def sums(self, t: int, got: Collected, global_state: StateDict) -> Collected:
        """``got`` (its updates checked and in client order) with its per-segment sums (and the segments withheld)."""

    def close(self) -> None:
        """Round's end, whether or not it was summed."""


class ClearSums:
    """Sums in the clear, from the updates themselves: the reference a secure transport must equal."""

    def open(
        self, t: int, cohort: Sequence[str], plans: Mapping[str, ClientPlan], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        pass

    def sums(self, t: int, got: Collected, global_state: StateDict) -> Collected:
        return replace(got, sums=plain_sums(global_state, [(u.client, u.state, u.samples) for u in got.updates]))

    def close(self) -> None:
        pass


class Summed(Wrapped):
    """``inner``'s rounds, each as its valid updates' per-segment sums made by ``transport``; the updates keep only
    what was reported (an empty ``state``)."""

    def __init__(self, inner: Collector, transport: SumsTransport) -> None:
        super().__init__(inner)
        self.transport = transport

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, ClientPlan],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        try:
            self.transport.open(t, cohort, plans, global_state)
            got = self.inner.collect(t, cohort, plans, global_state, lr)
            updates = sorted(got.updates, key=lambda u: u.client)
            for u in updates:
                check_payload(dict(global_state), u.state)
            summed = self.transport.sums(t, replace(got, updates=updates), dict(global_state))
        finally:
            self.transport.close()
        return replace(summed, updates=[replace(u, state={}) for u in summed.updates])
