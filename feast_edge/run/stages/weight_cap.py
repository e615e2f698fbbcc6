"""The cap on self-reported example counts as a release stage (feast_edge.aggregate.weights, method §6.2): a count
weighs at most ``max_weight_ratio`` times the round's median (0: no cap), or, where the scheduler notes
``FLEET_COUNTS`` (asynchronous releases of a few updates), the median of every device's latest count; the record
notes each capped client."""

from __future__ import annotations

from dataclasses import replace

from feast_edge.aggregate.weights import bounded_weights
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import FLEET_COUNTS, BaseStage, RoundContext, StateDict


class WeightCapStage(BaseStage):
    def __init__(self, max_weight_ratio: float) -> None:
        self.ratio = max_weight_ratio

    def prepare(self, ctx: RoundContext, global_state: StateDict, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        fleet = ctx.notes.get(FLEET_COUNTS, ())  # an asynchronous release: every device's latest count
        weights = bounded_weights([u.samples for u in updates], [u.self_reported for u in updates], self.ratio, fleet)
        if ctx.record is not None:
            ctx.record.capped = {u.client: [u.samples, w] for u, w in zip(updates, weights) if w != u.samples}
        return [u if w == u.samples else replace(u, samples=w) for u, w in zip(updates, weights)]
