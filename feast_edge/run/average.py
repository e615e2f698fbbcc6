"""The tail mean: the mean of the last K rounds' global weights, a second candidate beside the last round's own.

    window   = rounds max(1, R - K + 1) .. R, R the run's last round (settings.rounds), K = serve_average
    after each completed round r of the window:  mean += (w_r - mean) / n   (n: the rounds averaged so far;
                                                  floating tensors; integer ones, such as BN's batch count, the last's)
    at round R, where it is validated: the mean is validated beside the round's own weights, on the same held-out
    examples (feast_edge.evaluate.candidates chooses between them); checkpoint.safetensors keeps round R's own
    weights (training and resume never see the mean), best.safetensors the chosen one where the round is served

One round's weights carry that round's cohort and its sampling noise; the mean of the last rounds' does not, and on
label-skewed fleets it often scores above the last round (docs/benchmarks.md, "The served round on a label-skewed
fleet without server data"). But early in a short run the window reaches back to weights far from the last round's
(a 6-round run averaging rounds 2-6 loses 2 points): so the window fits the run, and the mean is served only where
it beats the round's own weights on the devices' held-out data.

Without a horizon (``--continuous``) every validation is such a round: the window is the last min(K, k) rounds up to
each validated round v (k = --eval-every; v - min(K, k) + 1 .. v), so windows never overlap and one running mean
serves them all; K then defaults to 5.

``K`` defaults to min(5, max(1, ⌈R/4⌉)) where devices validate (a server without data: 2 for a 6-round run, 5 from
17 rounds) and to 1 (the round's own weights, the paper's checkpoint selection, method §8) on server-held data;
``--serve-average K`` sets it for both. The running mean is kept in each checkpoint (tensors named ``average.*``), so
a resumed run validates the same mean; one written with another window is dropped, and the resume says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from feast_edge.settings.validated import RunError

PREFIX = "average."
WINDOW_MAX = 5  # rounds averaged at most by default where devices validate


def default_window(rounds: int | None) -> int:
    """The rounds averaged by default where devices validate: min(5, max(1, ⌈R/4⌉)) for an R-round run, 5 without a
    horizon (None)."""
    return WINDOW_MAX if rounds is None else min(WINDOW_MAX, max(1, math.ceil(rounds / 4)))


def serve_average_of(setting: int | None, validated_by_devices: bool, rounds: int | None, every: int = 1) -> int:
    """The rounds averaged into a validated round's second candidate: the setting, else :func:`default_window` where
    devices validate, else 1 (server-held data: the paper's selection); without a horizon at most ``every`` (the
    rounds between validations)."""
    k = setting if setting is not None else default_window(rounds) if validated_by_devices else 1
    return k if rounds is not None else max(1, min(k, every))


class TailAverage:
    """The running mean of the global weights over the last ``k`` of ``rounds`` rounds, or, without a horizon
    (``rounds`` None), over the last ``k`` before each validated round (every ``every``; see the module docstring)."""

    def __init__(self, rounds: int | None, k: int, every: int = 1) -> None:
        if k < 1:
            raise RunError(f"--serve-average {k} must be at least 1 (1: serve the round's own weights)")
        self.rounds, self.k, self.every = rounds, k, every
        self.mean: dict[str, torch.Tensor] = {}
        self.span: tuple[int, int] | None = None  # (first, last) round averaged so far

    @property
    def count(self) -> int:
        return 0 if self.span is None else self.span[1] - self.span[0] + 1

    def window(self, round_: int) -> tuple[int, int]:
        """(first, last): the window round ``round_`` (1-based) falls before: the run's last k rounds, or without a
        horizon the last k up to the next validated round."""
        last = self.rounds if self.rounds is not None else -(-round_ // self.every) * self.every
        return max(1, last - self.k + 1), last

    @property
    def first(self) -> int:
        """The first round of the window the mean is in (the run's last window before any round)."""
        return self.window(self.span[1] if self.span is not None else self.rounds or 1)[0]

    def add(self, round_: int, state: Mapping[str, torch.Tensor]) -> None:
        """Take round ``round_``'s global weights (1-based) into the mean, where it is in the window."""
        first, _ = self.window(round_)
        if self.k == 1 or round_ < first:
            return
        if self.span is None or self.span[1] != round_ - 1 or self.span[0] < first:  # a new window, or a gap
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
        """Whether the mean is a candidate of round ``round_``: the run's last round, with at least two rounds averaged."""
        last = self.window(round_)[1]
        return round_ == last and self.span is not None and self.span[1] == round_ and self.count >= 2

    def candidate(self, round_: int) -> tuple[tuple[int, int], dict[str, torch.Tensor]] | None:
        """(span, the mean's tensors) where the mean is round ``round_``'s second candidate, else None."""
        if not self.stands_in(round_):
            return None
        assert self.span is not None
        return self.span, self.mean

    # ------------------------------------------------------------------ checkpoints
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps: the mean, under ``average.``."""
        return {PREFIX + name: tensor for name, tensor in self.mean.items()}

    @property
    def fields(self) -> dict[str, Any]:
        """The record a checkpoint keeps beside the tensors: {"span": [first, last], "k": K}, or {} while none."""
        return {} if self.span is None else {"span": list(self.span), "k": self.k}

    def load(self, tensors: Mapping[str, torch.Tensor], fields: Mapping[str, Any], path: Path | None) -> str | None:
        """The mean from a checkpoint (its ``average.*`` tensors and record). A mean of another window (the run's
        --rounds or --serve-average changed) or without its record is dropped, and the window starts again at the
        next round in it; returns what a resume should say of a dropped mean (None: none was dropped)."""
        mean = {name[len(PREFIX) :]: tensor.clone() for name, tensor in tensors.items() if name.startswith(PREFIX)}
        span = fields.get("span")
        self.mean, self.span = {}, None
        if not mean:
            return None
        if self.k > 1 and isinstance(span, list) and len(span) == 2:
            first, last = int(span[0]), int(span[1])
            if self.window(last)[0] <= first <= last and fields.get("k", self.k) == self.k:
                self.mean, self.span = mean, (first, last)
                return None
            shown = f"rounds {first}-{last}"
        else:
            shown = "an earlier window"
        now = (
            f"averages the last {self.k} rounds before each validation, starting again at the next window"
            if self.k > 1 and self.rounds is None
            else f"averages rounds {self.first}-{self.rounds} (the last {self.k}), starting again at its next round in them"
            if self.k > 1
            else "serves the rounds' own weights (--serve-average 1)"
        )
        return (
            f"{path}: the stored mean of {shown}'s weights was dropped: it was written with another window "
            f"(--serve-average or --rounds); this run {now}"
        )


def split_extra(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's extra tensors as (the release's, the tail average's)."""
    ours = {name: tensor for name, tensor in tensors.items() if name.startswith(PREFIX)}
    return {name: tensor for name, tensor in tensors.items() if name not in ours}, ours


@contextmanager
def loaded(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None) -> Iterator[None]:
    """While inside, ``model`` holds ``state`` (nothing changes for None); its own weights are back afterwards, even
    after an error. Copies in place, so aliases of the model's tensors (a validator's global state) see it."""
    if state is None:
        yield
        return
    own = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(state)
    try:
        yield
    finally:
        model.load_state_dict(own)
