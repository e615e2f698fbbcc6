"""The last round's served candidate: the mean of the last K rounds' global weights (tail averaging).

    window   = rounds max(1, R - K + 1) .. R, R the run's last round (settings.rounds), K = serve_average
    after each completed round r of the window:  mean += (w_r - mean) / n   (n: the rounds averaged so far;
                                                  floating tensors; integer ones, such as BN's batch count, the last's)
    at round R, where it is validated: the mean stands in the model for the validation, the served-round choice and
    best.safetensors; checkpoint.safetensors keeps round R's own weights (training and resume never see the mean)

One round's weights carry that round's cohort and its sampling noise; the mean of the last rounds' does not, and on
label-skewed fleets it scores level with the mean of those rounds' scores where one round may miss it by more than a
point (docs/benchmarks.md, "The served round on a label-skewed fleet without server data"). The mean is a candidate like any round: the
served-round rule (feast_edge.evaluate.served_round) serves it only where its validation shows no regression.

``K`` defaults to 5 where devices validate (a server without data: the mean is what they test) and to 1 (the round's
own weights, the paper's checkpoint selection, method §8) on server-held data; ``--serve-average K`` sets it for both.
The running mean is kept in each checkpoint (tensors named ``average.*``), so a resumed run serves the same mean.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from feast_edge.run.settings import RunError

PREFIX = "average."
DEVICE_DEFAULT = 5  # rounds averaged where devices validate (no --serve-average)


def serve_average_of(setting: int | None, validated_by_devices: bool) -> int:
    """The rounds averaged into the last round's candidate: the setting, else 5 where devices validate, else 1."""
    if setting is not None:
        return setting
    return DEVICE_DEFAULT if validated_by_devices else 1


class TailAverage:
    """The running mean of the global weights over the last ``k`` of ``rounds`` rounds (see the module docstring)."""

    def __init__(self, rounds: int, k: int) -> None:
        if k < 1:
            raise RunError(f"--serve-average {k} must be at least 1 (1: serve the round's own weights)")
        self.rounds, self.k = rounds, k
        self.first = max(1, rounds - k + 1)  # the window's first round
        self.mean: dict[str, torch.Tensor] = {}
        self.span: tuple[int, int] | None = None  # (first, last) round averaged so far

    @property
    def count(self) -> int:
        return 0 if self.span is None else self.span[1] - self.span[0] + 1

    def add(self, round_: int, state: Mapping[str, torch.Tensor]) -> None:
        """Take round ``round_``'s global weights (1-based) into the mean, where it is in the window."""
        if self.k == 1 or round_ < self.first:
            return
        if self.span is None or self.span[1] != round_ - 1:  # a gap (a resume without the mean): start again here
            self.mean = {name: tensor.detach().clone() for name, tensor in state.items()}
            self.span = (round_, round_)
            return
        n = self.count + 1
        for name, tensor in state.items():
            kept = self.mean[name]
            if kept.is_floating_point():
                kept.add_(tensor.detach().to(kept.dtype) - kept, alpha=1.0 / n)
            else:
                kept.copy_(tensor)
        self.span = (self.span[0], round_)

    def stands_in(self, round_: int) -> bool:
        """Whether the mean is round ``round_``'s candidate: the run's last round, with at least two rounds averaged."""
        return round_ == self.rounds and self.span is not None and self.span[1] == round_ and self.count >= 2

    @contextmanager
    def standing_in(self, model: torch.nn.Module, round_: int, validated: bool) -> Iterator[tuple[int, int] | None]:
        """While inside: the model holds the mean where it is round ``round_``'s candidate and the round is
        ``validated`` (yields its span), else its own weights (yields None); its own weights are back afterwards.
        Copies in place, so aliases of the model's tensors see the mean."""
        if not (validated and self.stands_in(round_)):
            yield None
            return
        own = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        model.load_state_dict(self.mean)
        try:
            yield self.span
        finally:
            model.load_state_dict(own)

    # ------------------------------------------------------------------ checkpoints
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps: the mean, under ``average.``."""
        return {PREFIX + name: tensor for name, tensor in self.mean.items()}

    @property
    def fields(self) -> dict[str, Any]:
        """The record a checkpoint keeps beside the tensors: {"span": [first, last]}, or {} while none."""
        return {} if self.span is None else {"span": list(self.span)}

    def load(self, tensors: Mapping[str, torch.Tensor], fields: Mapping[str, Any], path: Path) -> None:
        """The mean from a checkpoint (its ``average.*`` tensors and record); a mean of another window or without
        its record is dropped, and the window starts again at the next round."""
        mean = {name[len(PREFIX) :]: tensor.clone() for name, tensor in tensors.items() if name.startswith(PREFIX)}
        span = fields.get("span")
        self.mean, self.span = {}, None
        if self.k == 1 or not mean or not isinstance(span, list) or len(span) != 2:
            return
        first, last = int(span[0]), int(span[1])
        if first < self.first or last < first:  # another window (the run's --rounds changed)
            return
        self.mean, self.span = mean, (first, last)


def split_extra(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's extra tensors as (the release's, the tail average's)."""
    ours = {name: tensor for name, tensor in tensors.items() if name.startswith(PREFIX)}
    return {name: tensor for name, tensor in tensors.items() if name not in ours}, ours
