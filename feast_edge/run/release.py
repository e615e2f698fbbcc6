"""What turns a round's collected updates into the next global model: one composed object, a pipeline of stages.

    admit    before anything is sent, each stage may refuse the round (:class:`RunStops`: a privacy budget)
    prepare  the valid updates (client-id order) pass through each stage in turn (clipping, weight caps)
    begin    each stage sees the global model before aggregation (a server optimizer's snapshot)
    the method's aggregation, in place (method §6; a robust rule is the method's own)
    finish   each stage in turn, in place (privacy noise, then a server optimizer's step)

A collector may deliver per-segment sums instead of updates (feast_edge.aggregate.segments): ``apply_sums`` releases
them (method §6 from the sums) when the method takes sums and every stage says ``takes_sums``; a stage that needs
single updates (clipping each, capping each weight) refuses such a run with the reason.

A stage implements those of the four steps it needs (:class:`BaseStage` gives the others as no-ops) and may keep state
that the checkpoint stores beside the weights (``state`` / ``load``). ``feast_edge.run.stages.release_of`` composes the
stages a run's settings ask for, in their fixed order; the run loop (feast_edge.run.loop) knows none of them by name.
A new stage is a new module in feast_edge/run/stages/ and one line in ``release_of`` (CONTRIBUTING.md, "Where a
change goes").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from feast_edge.aggregate.segments import SegmentSums
from feast_edge.errors import FeastError
from feast_edge.run.collect import ClientUpdate
from feast_edge.settings.validated import RunError

if TYPE_CHECKING:
    from feast_edge.run.round_record import RoundMethod, RoundRecord

StateDict = dict[str, torch.Tensor]
FLEET_COUNTS = "fleet_counts"  # RoundContext.notes: the latest example count of every device heard from (async)


class RunStops(FeastError):
    """A stage refuses the next round: the run ends before it, saying why (e.g. the privacy budget is spent)."""


class EndRequested(Exception):
    """A stop was requested while a step waited for its clients (feast-server stop): the run ends before that step,
    its last round checkpointed, and can be resumed."""


@dataclass
class RoundContext:
    """One round as the stages see it."""

    t: int  # 0-based
    population: int  # the clients the cohort was drawn from
    cohort: list[str]
    history: Sequence[RoundRecord]  # the rounds before this one
    record: RoundRecord | None = None  # this round's, once its updates are collected (stages note what they did)
    notes: dict[str, Any] = field(default_factory=dict)  # what one stage's steps pass to its later ones
    sampled: bool = True  # the cohort is a uniform sample of the population (an asynchronous release's is not)
    # a sample that is not uniform (a stratified secure cohort, feast_edge.run.cohort): the largest probability that
    # one client is in it, the rate DP accounts the round at; None: m / population
    inclusion: float | None = None


class Stage(Protocol):
    """One step of the release (see the module docstring)."""

    takes_sums: bool  # works on per-segment sums as well as on single updates

    def admit(self, ctx: RoundContext) -> None: ...

    def prepare(
        self, ctx: RoundContext, global_state: StateDict, updates: list[ClientUpdate]
    ) -> list[ClientUpdate]: ...

    def begin(self, ctx: RoundContext, global_state: StateDict) -> None: ...

    def finish(
        self, ctx: RoundContext, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, Any]
    ) -> None: ...

    @property
    def state(self) -> dict[str, torch.Tensor]: ...

    def load(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None: ...


class BaseStage:
    """The steps a stage does not need: nothing happens."""

    takes_sums = False  # a stage that never looks at single updates may say True

    def admit(self, ctx: RoundContext) -> None:
        return None

    def prepare(self, ctx: RoundContext, global_state: StateDict, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        return updates

    def begin(self, ctx: RoundContext, global_state: StateDict) -> None:
        return None

    def finish(
        self, ctx: RoundContext, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, Any]
    ) -> None:
        return None

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def load(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        return None


class Release:
    """The method's aggregation wrapped in ``stages`` (in order)."""

    def __init__(self, method: RoundMethod, stages: Sequence[Stage]) -> None:
        self.method = method
        self.stages = list(stages)

    def admit(self, ctx: RoundContext) -> None:
        for stage in self.stages:
            stage.admit(ctx)

    def prepare(self, ctx: RoundContext, global_state: StateDict, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        for stage in self.stages:
            updates = stage.prepare(ctx, global_state, updates)
        return updates

    def apply(
        self, ctx: RoundContext, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, Any]
    ) -> None:
        """The new global model, in place: each stage's ``begin``, the aggregation, each stage's ``finish``."""
        for stage in self.stages:
            stage.begin(ctx, global_state)
        self.method.aggregate(ctx.t, global_state, updates, plans)
        for stage in self.stages:
            stage.finish(ctx, global_state, updates, plans)

    def apply_sums(self, ctx: RoundContext, global_state: StateDict, sums: SegmentSums) -> None:
        """The new global model from per-segment sums, in place: each stage's ``begin``, method §6 from the sums,
        each stage's ``finish``; a RunError naming what needs single updates otherwise."""
        aggregate_sums = getattr(self.method, "aggregate_sums", None)
        if aggregate_sums is None:
            raise RunError(f"{type(self.method).__name__} aggregates single updates; this collector delivers sums")
        needing = [type(stage).__name__ for stage in self.stages if not stage.takes_sums]
        if needing:
            raise RunError(
                f"this collector delivers per-segment sums, and {', '.join(needing)} needs each device's update: "
                "drop the setting that adds it (a cap on self-reported counts, central DP's clipping, a server "
                "optimizer)"
            )
        for stage in self.stages:
            stage.begin(ctx, global_state)
        aggregate_sums(ctx.t, global_state, sums)
        for stage in self.stages:
            finish_sums = getattr(stage, "finish_sums", None)  # a stage that needs the sums' shape (DP's counts)
            if finish_sums is not None:
                finish_sums(ctx, global_state, sums)
            else:
                stage.finish(ctx, global_state, [], {})

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint stores of the stages (their names never collide: each stage prefixes its own)."""
        return {name: tensor for stage in self.stages for name, tensor in stage.state.items()}

    def load(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        """Give each stage its state back from a checkpoint (whose settings matched this run's); state no stage keeps
        means the checkpoint was written with other settings."""
        kept = {name for stage in self.stages for name in stage.state}
        stray = sorted(set(tensors) - kept)
        if stray:
            raise RunError(
                f"{path} holds state this run keeps none of ({len(stray)} tensors, e.g. {stray[0]}): it was written "
                "with another --server-opt; rerun with the checkpoint's --server-opt settings"
            )
        for stage in self.stages:
            stage.load(tensors, path)
