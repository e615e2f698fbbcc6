"""Honest selection of a device's personal model: method and strength chosen on a selection split of its training data.

    training split ──holdout_split(SELECTION_SHARE, seed SELECTION_SEED)──> fit examples + selection examples
    each candidate (method, strength) is fitted on the fit examples and counted on the selection examples
    auto:   the best candidate, only if it gets more selection examples right than the served model; else none
    METHOD: that method's best strength (said plainly when it is not better than the served model)

The held-out split the device reports on is never looked at here: :func:`personal_step` measures the served and the
personal model on it only after the choice is made, so the reported gain is not the selection's optimism.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from feast_edge.data.holdout import holdout_split
from feast_edge.errors import FeastError
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.personalize.finetune import FINE_TUNED, fine_tuned
from feast_edge.personalize.prior import class_prior, prior_corrected, prior_offsets
from feast_edge.personalize.tuned import Tuned
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet

METHODS = ("prior", *FINE_TUNED)
CHOICES = ("auto", "off", *METHODS)
# The strengths each method is tried at: τ for prior, epochs for head and bn, μ for proximal (bench/bench_personalize.py).
STRENGTHS: dict[str, tuple[float, ...]] = {
    "prior": (0.25, 0.5, 1.0, 1.5, 2.0),
    "head": (1, 3, 10),
    "bn": (1, 3),
    "proximal": (0.1, 1.0),
}
STRENGTH_NAME = {"prior": "tau", "head": "epochs", "bn": "epochs", "proximal": "mu"}
MAX_STRENGTH = {"prior": 4.0, "head": 20, "bn": 20, "proximal": 100.0}
SELECTION_SHARE = 0.2  # of the training split, per class, kept to choose on
SELECTION_SEED = 1
MIN_TRAINING = 40  # training examples a device needs before it personalizes
MIN_SELECTION = 10  # selection examples the choice is made on, at least
MAX_FIT = 2000  # fine-tuning examples at most (a seeded sample): bounds the device time whatever the device holds


class PersonalizeError(FeastError, ValueError):
    """A personalization setting is not one this toolkit knows."""


@dataclass(frozen=True)
class Choice:
    """What the device was asked to do: ``auto``, ``off``, or one method (at a fixed strength, or chosen)."""

    method: str
    strength: float | None = None

    @classmethod
    def parse(cls, text: str) -> Choice:
        """``auto``, ``off``, ``METHOD`` or ``METHOD:STRENGTH`` (e.g. ``prior:0.5``); PersonalizeError naming the choices."""
        words = ", ".join(CHOICES)
        match = re.fullmatch(r"\s*([a-z]+)\s*(?::\s*([0-9.eE+-]+)\s*)?", str(text))
        if not match or match.group(1) not in CHOICES:
            raise PersonalizeError(
                f"--personalize {str(text)[:40]!r} is unknown; choose one of {words}, or METHOD:STRENGTH (e.g. prior:0.5)"
            )
        method, raw = match.group(1), match.group(2)
        if raw is None:
            return cls(method)
        if method in ("auto", "off"):
            raise PersonalizeError(f"--personalize {method} takes no strength; write e.g. prior:0.5 or head:3")
        try:
            strength = float(raw)
        except ValueError:
            strength = math.nan
        low = 1 if method in ("head", "bn") else 0
        if not low <= strength <= MAX_STRENGTH[method] or (low == 1 and strength != int(strength)):
            kind = "a whole number of epochs" if low == 1 else "a number"
            raise PersonalizeError(
                f"--personalize {method}:{raw}: its {STRENGTH_NAME[method]} must be {kind} in [{low}, "
                f"{MAX_STRENGTH[method]:g}]"
            )
        return cls(method, strength)

    def __str__(self) -> str:
        return self.method if self.strength is None else f"{self.method}:{self.strength:g}"

    def candidates(self) -> list[tuple[str, tuple[float, ...]]]:
        """(method, strengths) to try."""
        if self.method == "off":
            return []
        if self.strength is not None:
            return [(self.method, (self.strength,))]
        methods = METHODS if self.method == "auto" else (self.method,)
        return [(m, STRENGTHS[m]) for m in methods]


@dataclass(frozen=True)
class Candidate:
    """One tried personal model: its selection-split correct count and mean cross-entropy, and the device time it took."""

    method: str
    strength: float
    correct: int
    loss: float
    seconds: float


@dataclass(frozen=True)
class Personalized:
    """The outcome of :func:`personalize`: the personal model (None: the served model stays alone) and why."""

    model: StaticResNet | None
    method: str = ""
    strength: float | None = None
    reason: str = ""  # one line: what was chosen and why, or why there is no personal model
    fit_examples: int = 0
    selection_examples: int = 0
    selection_global: int = 0  # correct on the selection split
    selection_personal: int | None = None
    candidates: tuple[Candidate, ...] = field(default=())
    tuned: Tuned | None = None  # the classes of the training split it was tuned on (None: no personal model)

    def metadata(self) -> dict[str, Any]:
        """What the personal model's files and reports say of it (JSON values)."""
        n = self.selection_examples
        return {
            **({} if self.tuned is None else self.tuned.to_dict()),
            "personal_method": self.method,
            "personal_strength": self.strength,
            "personal_strength_name": STRENGTH_NAME.get(self.method, ""),
            "personal_examples": self.fit_examples,
            "personal_selection_examples": n,
            "personal_selection_accuracy_global": self.selection_global / n if n else None,
            "personal_selection_accuracy": None
            if self.selection_personal is None or not n
            else self.selection_personal / n,
            "personal_reason": self.reason,
        }


def refusal(labels: torch.Tensor, holdout: int, choice: Choice) -> str:
    """Why a device with training ``labels`` and ``holdout`` held-out examples keeps only the served model ("" if not)."""
    if choice.method == "off":
        return "personalization is off (--personalize off)"
    if holdout == 0:
        return "no held-out split to measure a personal model on (give the device its own images, or --holdout > 0)"
    classes = int(torch.unique(labels).numel()) if labels.numel() else 0
    if classes < 2:
        return f"its training data holds {'one class' if classes else 'no examples'}; a personal model would only ever answer that class"
    if labels.numel() < MIN_TRAINING:
        return f"{labels.numel()} training examples, fewer than the {MIN_TRAINING} personalization needs"
    return ""


def _count(
    model: StaticResNet, images: torch.Tensor, labels: torch.Tensor, preset: Preset, device: str | torch.device
) -> int:
    """``model``'s correct predictions on ``images``, counted on ``device`` (the model is left on the CPU)."""
    return _score(model, images, labels, preset, device)[0]


@torch.no_grad()
def _score(
    model: StaticResNet, images: torch.Tensor, labels: torch.Tensor, preset: Preset, device: str | torch.device
) -> tuple[int, float]:
    """``model``'s correct predictions on ``images`` and its mean cross-entropy there, computed on ``device`` (the
    model is left on the CPU)."""
    model.to(device).eval()
    try:
        correct, loss = 0, 0.0
        for x, y in zip(pixel_batches(images, preset, 500, device), labels.split(500)):
            logits = model(x).float()
            y = y.to(logits.device)
            correct += int((logits.argmax(dim=1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        return correct, loss / max(1, int(labels.shape[0]))
    finally:
        model.cpu()


def _sample(count: int, cap: int, seed: int) -> torch.Tensor:
    """At most ``cap`` of ``count`` positions, a seeded sample in ascending order (all of them when ``count <= cap``)."""
    if count <= cap:
        return torch.arange(count)
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:cap].sort().values


def fitted_candidates(
    served: StaticResNet,
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    choice: Choice,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, float, StaticResNet, float]]:
    """Every candidate ``choice`` names fitted on uint8 ``images``: (method, strength, model, device seconds it took).
    Fine-tuning sees at most MAX_FIT of them (a seeded sample); prior correction counts them all."""
    tuned = _sample(int(labels.shape[0]), MAX_FIT, seed)
    for method, strengths in choice.candidates():
        began = time.perf_counter()
        if method == "prior":
            prior = class_prior(labels, preset.classes)
            models = [prior_corrected(served, prior_offsets(prior, tau)) for tau in strengths]
        else:
            generator = torch.Generator().manual_seed(seed)
            models = fine_tuned(served, images[tuned], labels[tuned], preset, method, strengths, generator, device)
        seconds = (time.perf_counter() - began) / len(models)
        for strength, model in zip(strengths, models):
            yield method, float(strength), model, seconds


def personalize(
    served: StaticResNet,
    images: torch.Tensor,
    labels: torch.Tensor,
    preset: Preset,
    choice: Choice,
    *,
    holdout: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Personalized:
    """The device's personal model of ``served`` from its training split (uint8 ``images``, ``labels``), chosen on a
    selection split carved from it; ``holdout``: the size of the held-out split it will be reported on."""
    why = refusal(labels, holdout, choice)
    if why:
        return Personalized(None, reason=why)
    fit, select = holdout_split(labels, SELECTION_SHARE, SELECTION_SEED)
    if len(select) < MIN_SELECTION:
        return Personalized(
            None,
            reason=f"{labels.numel()} training examples leave {len(select)} to choose on, fewer than {MIN_SELECTION}",
        )
    sel_images, sel_labels = images[select], labels[select]
    fit_images, fit_labels = images[fit], labels[fit]
    tuned = _sample(len(fit), MAX_FIT, seed)
    baseline, baseline_loss = _score(served, sel_images, sel_labels, preset, device)
    tried: list[tuple[Candidate, StaticResNet]] = []
    for method, strength, model, seconds in fitted_candidates(
        served, fit_images, fit_labels, preset, choice, seed=seed, device=device
    ):
        correct, loss = _score(model, sel_images, sel_labels, preset, device)
        tried.append((Candidate(method, strength, correct, loss, seconds), model))
    # auto ships only a candidate with more selection examples right than the served model; among those (and among a
    # named method's strengths) the lowest cross-entropy wins: a few dozen selection examples often leave several
    # candidates with the same count, and the loss tells them apart where the count cannot (docs/personalization.md).
    better = [t for t in tried if t[0].correct > baseline]
    best, model = min(better or tried, key=lambda t: t[0].loss)
    n = len(select)
    said = (
        f"{best.method} ({STRENGTH_NAME[best.method]} {best.strength:g}): {best.correct}/{n} right on its selection "
        f"split (loss {best.loss:.3f}) against {baseline}/{n} (loss {baseline_loss:.3f}) for the served model"
    )
    common: dict[str, Any] = {
        "fit_examples": len(tuned) if best.method != "prior" else len(fit),
        "selection_examples": n,
        "selection_global": baseline,
        "candidates": tuple(c for c, _ in tried),
    }
    if choice.method == "auto" and not better:
        return Personalized(
            None, reason=f"no method beat the served model on the selection split (best: {said})", **common
        )
    note = "" if best.correct > baseline else " (asked for; not better than the served model there)"
    return Personalized(
        model,
        best.method,
        best.strength,
        f"chose {said}{note}",
        selection_personal=best.correct,
        tuned=Tuned.of_labels(labels, preset.task.classes),
        **common,
    )


@dataclass(frozen=True)
class OwnAccuracy:
    """A device's own held-out accuracy, served model → personal model (the same when it keeps only the served one)."""

    examples: int
    served: int  # correct
    personal: int

    @property
    def served_accuracy(self) -> float | None:
        return self.served / self.examples if self.examples else None

    @property
    def personal_accuracy(self) -> float | None:
        return self.personal / self.examples if self.examples else None


def personal_step(
    served: StaticResNet,
    images: torch.Tensor,
    labels: torch.Tensor,
    holdout_images: torch.Tensor,
    holdout_labels: torch.Tensor,
    preset: Preset,
    choice: Choice,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Personalized, OwnAccuracy]:
    """Personalize ``served`` on a device's training split, then count both models on its held-out split: the step
    the agent, ``feast-edge simulate --personalize`` and the Flower ClientApp all run."""
    holdout = int(holdout_labels.shape[0])
    outcome = personalize(served, images, labels, preset, choice, holdout=holdout, seed=seed, device=device)
    if not holdout:
        return outcome, OwnAccuracy(0, 0, 0)
    before = _count(served, holdout_images, holdout_labels, preset, device)
    after = before if outcome.model is None else _count(outcome.model, holdout_images, holdout_labels, preset, device)
    return outcome, OwnAccuracy(holdout, before, after)


def worst_decile(values: Sequence[float]) -> float:
    """The mean of the lowest tenth of ``values`` (at least one): the devices a fleet's mean hides."""
    ordered = sorted(values)
    k = max(1, len(ordered) // 10)
    return sum(ordered[:k]) / k
