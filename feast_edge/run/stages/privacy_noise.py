"""Client-level differential privacy as a release stage (feast_edge.privacy; docs/privacy.md).

admit    the round's DP record, or the run stops when it would take ε past --dp-epsilon
prepare  each update clipped to the round's bound, BN statistics kept global, uniform weights (central), or only
         the BN statistics taken from devices that clipped and noised their own (local)
finish   central DP: the noise of every routed coordinate's sum, in place

From per-segment sums (secure aggregation, feast_edge.secagg): the devices clipped before masking, with weight 1, so
each segment's summed weight is its count n_u; ``finish_sums`` adds the same noise per coordinate from those counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from feast_edge.aggregate.segments import SegmentSums, _index
from feast_edge.privacy.private_rounds import BudgetReached, PrivateRounds
from feast_edge.privacy.settings import DpSettings
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import BaseStage, RoundContext, RunStops, StateDict


class PrivacyStage(BaseStage):
    """One run's DP steps over the model's parameters ``params``."""

    def __init__(self, dp: DpSettings, params: Sequence[str], rounds: int, *, clients_noise: bool) -> None:
        self.rounds = PrivateRounds(dp, list(params), rounds, clients_noise=clients_noise)
        # Central DP with a fixed bound works on per-segment sums too: the devices clip, the server noises the sums.
        self.takes_sums = dp.mode == "central" and not dp.adaptive and not clients_noise

    def admit(self, ctx: RoundContext) -> None:
        earlier = [h.dp for h in ctx.history], [h.cohort for h in ctx.history]
        try:
            ctx.notes["dp"] = self.rounds.check_next(
                *earlier, ctx.t + 1, ctx.population, ctx.cohort, ctx.sampled, ctx.inclusion
            )
        except BudgetReached as exc:
            raise RunStops(str(exc)) from None

    def prepare(self, ctx: RoundContext, global_state: StateDict, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        dp = ctx.notes["dp"]
        states = self.rounds.privatize(global_state, [(u.client, u.state) for u in updates], ctx.t, dp)
        if ctx.record is not None:
            ctx.record.dp = dp  # the same dict: adaptive clipping's figures land in it
        return [replace(u, state=state, samples=1) for u, state in zip(updates, states)]

    def finish(
        self, ctx: RoundContext, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, Any]
    ) -> None:
        self.rounds.noise(global_state, [u.state for u in updates], ctx.t, ctx.notes["dp"])

    def finish_sums(self, ctx: RoundContext, global_state: StateDict, sums: SegmentSums) -> None:
        """Central DP over per-segment sums of clipped, uniformly weighted updates: the noise of every released
        coordinate's sum (its count: the segment's summed weight), in place; withheld coordinates get none."""
        if ctx.record is not None:
            ctx.record.dp = ctx.notes["dp"]
        self.rounds.noise_counts(
            global_state, sum_counts(global_state, sums, self.rounds.params), ctx.t, ctx.notes["dp"]
        )


def sum_counts(global_state: StateDict, sums: SegmentSums, params: Sequence[str]) -> dict:
    """Per parameter tensor: how many clipped updates each released position's sum holds (the segment's weight)."""
    import torch

    counts = {n: torch.zeros(global_state[n].shape, dtype=torch.float64) for n in params if n in global_state}
    for s in sums.sums:
        for name, cells in s.segment.cells.items():
            if name in counts:
                for cell in cells:
                    counts[name][_index(cell)] = round(s.weight)
    return counts
