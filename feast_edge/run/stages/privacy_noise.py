"""Client-level differential privacy as a release stage (feast_edge.privacy; docs/privacy.md).

admit    the round's DP record, or the run stops when it would take ε past --dp-epsilon
prepare  each update clipped to the round's bound, BN statistics kept global, uniform weights (central), or only
         the BN statistics taken from devices that clipped and noised their own (local)
finish   central DP: the noise of every routed coordinate's sum, in place
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from feast_edge.privacy.private_rounds import BudgetReached, PrivateRounds
from feast_edge.privacy.settings import DpSettings
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import BaseStage, RoundContext, RunStops, StateDict


class PrivacyStage(BaseStage):
    """One run's DP steps over the model's parameters ``params``."""

    def __init__(self, dp: DpSettings, params: Sequence[str], rounds: int, *, clients_noise: bool) -> None:
        self.rounds = PrivateRounds(dp, list(params), rounds, clients_noise=clients_noise)

    def admit(self, ctx: RoundContext) -> None:
        earlier = [h.dp for h in ctx.history], [h.cohort for h in ctx.history]
        try:
            ctx.notes["dp"] = self.rounds.check_next(*earlier, ctx.t + 1, ctx.population, ctx.cohort, ctx.sampled)
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
