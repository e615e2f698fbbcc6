"""Securely aggregated per-segment sums in one process (feast_edge.secagg.sums): the in-process devices encode, mask
and share as over a network, and the release sees only the unmasked segment sums (``feast-edge simulate
--secure-agg``). The transport of feast_edge.run.sums.Summed; its reference is ClearSums, its twin over MQTT
feast_edge.server.secure.MqttSecureSums."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import torch

from feast_edge.aggregate.checks import StateDict
from feast_edge.privacy.settings import DpSettings
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import Collected, Collector
from feast_edge.run.sums import Summed
from feast_edge.secagg.sums import SecureTerms, masked_clip, secure_sums
from feast_edge.settings.concerns import SecureAggregation

log = logging.getLogger(__name__)


class InProcessSecureSums:
    """Sums transport in process: each round's valid updates encoded, masked, shared and unmasked by in-process
    devices; the segments of fewer than c + 2 contributors are withheld with their reason."""

    def __init__(
        self, terms: SecureTerms, context: str = "", clip: float | None = None, params: Collection[str] = ()
    ) -> None:
        """``clip`` (central DP; None: no DP): the L2 bound every device clips its change of ``params`` (the
        parameters' names) to before masking (feast_edge.secagg.sums.dp_input); the release stage adds the noise."""
        self.terms, self.context, self.clip, self.params = terms, context, clip, params
        self.clipped = 0  # values clipped to ±bound before encoding, over the run
        self.upload_values: dict[str, int] = {}  # the last round's masked upload of each client, in 32-bit values

    def open(
        self, t: int, cohort: Sequence[str], plans: Mapping[str, ClientPlan], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        pass

    def sums(self, t: int, got: Collected, global_state: StateDict) -> Collected:
        if not got.updates:
            return got
        done = secure_sums(
            global_state,
            [(u.client, u.state, u.samples) for u in got.updates],
            colluders=self.terms.colluders,
            bound=self.terms.bound,
            context=f"{self.context}/round {t}",
            neighbours=self.terms.neighbours,
            clip=self.clip,
            params=self.params,
        )
        self.clipped += done.clipped
        self.upload_values = done.upload_values
        for members, reason in done.withheld.items():
            log.info("round %d: the segment of %s keeps its global value: %s", t + 1, members, reason)
        return replace(got, sums=done.sums, withheld=done.withheld)

    def close(self) -> None:
        pass


def in_process_secure_sums(
    inner: Collector,
    secure: SecureAggregation,
    dp: DpSettings | None,
    params: Collection[str],
    context: str = "simulation",
) -> Summed:
    """``inner``'s rounds as securely aggregated per-segment sums, masked in process.

    Args:
        inner: the collector whose cohort trains (the simulation's in-process clients).
        secure: c, the clipping bound B and the neighbour graph's degree (``--colluders``, ``--secagg-*``).
        dp: the run's DP settings: under central DP every device clips its parameters' change before masking.
        params: the names of the model's parameters (what central DP clips).
        context: what every round's setup is derived from, beside the round.
    """
    terms = SecureTerms(secure.colluders, secure.secagg_bound, secure.secagg_neighbours)
    return Summed(inner, InProcessSecureSums(terms, context, clip=masked_clip(dp), params=params))
