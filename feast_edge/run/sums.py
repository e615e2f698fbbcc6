"""A collector whose rounds come back as per-segment sums (feast_edge.aggregate.segments) computed in the clear from
another collector's updates: the reference a collector that never reveals single updates (secure aggregation,
feast_edge.secagg.collector) must equal, and the way to run the release's sums path on any collector."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from feast_edge.aggregate.checks import StateDict, check_payload
from feast_edge.aggregate.segments import plain_sums
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import ClientUpdate, Collected, Wrapped


class PlainSums(Wrapped):
    """``inner``'s rounds, each as its valid updates' per-segment sums; the updates keep only what was reported."""

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, ClientPlan],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        got = self.inner.collect(t, cohort, plans, global_state, lr)
        updates = sorted(got.updates, key=lambda u: u.client)
        for u in updates:
            check_payload(dict(global_state), u.state)
        summed = self.summed(t, got, dict(global_state), updates)
        return replace(summed, updates=[replace(u, state={}) for u in updates])

    def summed(self, t: int, got: Collected, global_state: StateDict, updates: list[ClientUpdate]) -> Collected:
        """``got`` with the sums of its (checked, sorted) ``updates``: here in the clear."""
        return replace(got, sums=plain_sums(global_state, [(u.client, u.state, u.samples) for u in updates]))
