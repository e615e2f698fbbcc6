"""A collector whose rounds come back as securely aggregated per-segment sums (feast_edge.secagg.sums): the
in-process devices encode, mask and share as over a network, and the release sees only the unmasked segment sums
(``feast-edge simulate --secure-agg``). Its plain twin, and the reference it is compared with, is
feast_edge.run.sums.PlainSums."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from feast_edge.aggregate.checks import StateDict
from feast_edge.privacy.settings import DpSettings
from feast_edge.run.collect import ClientUpdate, Collected, Collector
from feast_edge.run.sums import PlainSums
from feast_edge.secagg.sums import DEFAULT_BOUND, secure_sums

log = logging.getLogger(__name__)


class SecureSums(PlainSums):
    """``inner``'s rounds, each as the securely aggregated sums of its valid updates; the updates keep only what was
    reported, the withheld segments (fewer than c + 2 contributors) their reason."""

    def __init__(
        self,
        inner: Collector,
        colluders: int = 1,
        bound: float = DEFAULT_BOUND,
        context: str = "",
        neighbours: int = 0,
        dp_clip: tuple[float, Collection[str]] | None = None,
    ) -> None:
        """``dp_clip`` (central DP): the clipping bound every device applies to its parameters' change, and their
        names (feast_edge.secagg.sums.dp_input); the release stage adds the noise to the unmasked sums."""
        super().__init__(inner)
        self.colluders, self.bound, self.context, self.neighbours = colluders, bound, context, neighbours
        self.dp_clip = dp_clip
        self.clipped = 0  # values clipped to ±bound before encoding, over the run
        self.upload_values: dict[str, int] = {}  # the last round's masked upload of each client, in 32-bit values

    def summed(self, t: int, got: Collected, global_state: StateDict, updates: list[ClientUpdate]) -> Collected:
        if not updates:
            return got
        done = secure_sums(
            global_state,
            [(u.client, u.state, u.samples) for u in updates],
            colluders=self.colluders,
            bound=self.bound,
            context=f"{self.context}/round {t}",
            neighbours=self.neighbours,
            clip=None if self.dp_clip is None else self.dp_clip[0],
            params=() if self.dp_clip is None else self.dp_clip[1],
        )
        self.clipped += done.clipped
        self.upload_values = done.upload_values
        for members, reason in done.withheld.items():
            log.info("round %d: the segment of %s keeps its global value: %s", t + 1, members, reason)
        return replace(got, sums=done.sums, withheld=done.withheld)


def secure_dp_clip(dp: DpSettings | None, params: Collection[str]) -> tuple[float, Collection[str]] | None:
    """Under central DP, what every device clips before masking: the bound and the parameters' names; else None."""
    return None if dp is None or dp.mode != "central" else (dp.clip, params)
