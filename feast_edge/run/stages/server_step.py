"""A server optimizer as a release stage (feast_edge.aggregate.server_opt): the aggregate becomes a pseudo-gradient
from the model before the round, and the optimizer steps from there at the positions some update covered (method §6.2).
Its state (momentum, moments) is checkpointed beside the weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from feast_edge.aggregate.server_opt import ServerOpt, ServerOptimizer
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import BaseStage, RoundContext, StateDict
from feast_edge.settings.validated import RunError


class ServerStepStage(BaseStage):
    def __init__(self, opt: ServerOpt, shapes: Mapping[str, tuple[int, ...]], method: Any) -> None:
        self.optimizer = ServerOptimizer(opt, shapes)
        self.method = method  # its routed positions (RoundMethod.routed)
        self.before: StateDict = {}

    def begin(self, ctx: RoundContext, global_state: StateDict) -> None:
        self.before = self.optimizer.snapshot(global_state)

    def finish(
        self, ctx: RoundContext, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, Any]
    ) -> None:
        routed = self.method.routed(global_state, updates, list(self.optimizer.shapes))
        self.optimizer.step(global_state, self.before, routed)
        self.before = {}

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.optimizer.state

    def load(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        try:
            self.optimizer.load(tensors)
        except ValueError as exc:
            raise RunError(f"cannot resume from {path}: {exc}; rerun with the checkpoint's --server-opt") from None
