"""What the releases moved, as a release stage (feast_edge.aggregate.released): under secure aggregation
(``--secure-agg``) a withheld segment keeps its value, so the served variants are those whose every position some
release moved (docs/security.md §10). It changes nothing in the model; its bits are checkpointed beside the weights,
so a resumed run, and the export from a checkpoint, decide the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from feast_edge.aggregate.released import Released
from feast_edge.aggregate.segments import SegmentSums
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import BaseStage, Release, RoundContext, StateDict
from feast_edge.settings.validated import RunError


class ReleasedStage(BaseStage):
    """Marks what each release moved: the released segments' cells (sums), or every routed position (updates)."""

    takes_sums = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.released = Released(model.state_dict())

    def finish(
        self, ctx: RoundContext, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, Any]
    ) -> None:
        self.released.add_routed(u.state for u in updates)

    def finish_sums(self, ctx: RoundContext, global_state: StateDict, sums: SegmentSums) -> None:
        self.released.add_sums(sums)

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.released.tensors()

    def load(self, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
        try:
            self.released.load(tensors)
        except ValueError:
            raise RunError(
                f"{path} holds no record of the positions its secure rounds released (it was written by an earlier "
                "feast-edge), so the variants it may serve cannot be told: start the run again in another --out"
            ) from None


def released_of(release: Release) -> Released | None:
    """The release's record of what moved, where it keeps one (``--secure-agg``); None otherwise."""
    return next((s.released for s in release.stages if isinstance(s, ReleasedStage)), None)
