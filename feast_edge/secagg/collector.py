"""A collector whose rounds come back as securely aggregated per-segment sums (feast_edge.secagg.sums): the
in-process devices encode, mask and share as over a network, and the release sees only the unmasked segment sums
(``feast-edge simulate --secure-agg``). The plain twin is feast_edge.run.sums.PlainSums."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from feast_edge.aggregate.checks import check_payload
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import Collected, Collector, Wrapped
from feast_edge.secagg.sums import DEFAULT_BOUND, secure_sums

log = logging.getLogger(__name__)


class SecureSums(Wrapped):
    """``inner``'s rounds, each as the securely aggregated sums of its valid updates; the updates keep only what was
    reported, the withheld segments (fewer than c + 2 contributors) their reason."""

    def __init__(self, inner: Collector, colluders: int = 1, bound: float = DEFAULT_BOUND, context: str = "") -> None:
        super().__init__(inner)
        self.colluders, self.bound, self.context = colluders, bound, context
        self.clipped = 0  # values clipped to ±bound before encoding, over the run
        self.upload_values: dict[str, int] = {}  # the last round's masked upload of each client, in 32-bit values

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
        if not updates:
            return got
        for u in updates:
            check_payload(dict(global_state), u.state)
        done = secure_sums(
            dict(global_state),
            [(u.client, u.state, u.samples) for u in updates],
            colluders=self.colluders,
            bound=self.bound,
            context=f"{self.context}/round {t}",
        )
        self.clipped += done.clipped
        self.upload_values = done.upload_values
        for members, reason in done.withheld.items():
            log.info("round %d: the segment of %s keeps its global value: %s", t + 1, members, reason)
        return replace(got, updates=[replace(u, state={}) for u in updates], sums=done.sums, withheld=done.withheld)
