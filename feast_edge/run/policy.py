"""When collected input becomes a model: a release policy decides, from one step's valid input, whether the release
(feast_edge.run.release) turns it into the next global model now.

    EveryRound   the synchronous rule: each round's valid updates (or per-segment sums) are released when at least
                 ``min_clients`` devices contributed; otherwise the model stays as it was

A policy that keeps input across steps (a buffer released every K updates, weighted by staleness) is another class
with this method, beside this one (CONTRIBUTING.md, "Where a change goes").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from feast_edge.aggregate.segments import SegmentSums
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import Release, RoundContext, StateDict


class ReleasePolicy(Protocol):
    def release(
        self,
        ctx: RoundContext,
        global_state: StateDict,
        valid: list[ClientUpdate],
        plans: Mapping[str, Any],
        sums: SegmentSums | None,
    ) -> bool:
        """Release (in place) or not; True when ``global_state`` became the next model."""
        ...


class EveryRound:
    """Synchronous rounds: release each round's input once ``min_clients`` devices contributed to it."""

    def __init__(self, pipeline: Release, min_clients: int) -> None:
        self.pipeline = pipeline
        self.min_clients = min_clients

    def release(
        self,
        ctx: RoundContext,
        global_state: StateDict,
        valid: list[ClientUpdate],
        plans: Mapping[str, Any],
        sums: SegmentSums | None,
    ) -> bool:
        if sums is not None:
            if len(sums.contributors) < self.min_clients:
                return False
            self.pipeline.apply_sums(ctx, global_state, sums)
            return True
        if len(valid) < self.min_clients:
            return False
        self.pipeline.apply(ctx, global_state, valid, plans)
        return True
