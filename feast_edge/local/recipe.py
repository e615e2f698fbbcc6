"""The local-training recipe (method §7): hyper-parameters, the paper's ablation switch, the lr schedule over the horizon.

A preset's ``[train]`` table, the CLI's overrides and a round message all
resolve to one :class:`TrainConfig`; nothing here trains, so the protocol and
the batch pipeline can read a recipe without importing the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from feast_edge.errors import FeastError
from feast_edge.local.augment import DEFAULT_POLICY, POLICIES
from feast_edge.space.preset import load_preset

VARIANT_MODES = ("min", "max", "min+max", "min+max+kd", "full")


class TrainError(FeastError, ValueError):
    """Local training was given inputs it cannot train on."""


@dataclass(frozen=True)
class TrainConfig:
    """Local-training hyper-parameters (method §7 defaults) and the paper's ablation switch ``variants``.

    ``variants``: ``"min"`` (global-min only), ``"max"`` (local-max only),
    ``"min+max"`` (no KD), ``"min+max+kd"``, ``"full"`` (min + rand + max + KD).
    """

    lr: float = 0.025
    momentum: float = 0.9
    weight_decay: float = 1e-4
    clip_norm: float = 10.0
    kd_weight: float = 0.5  # rho
    temperature: float = 1.0
    batch_size: int = 64
    epochs: int = 1
    mixup_alpha: float = 0.4
    cutmix_alpha: float = 1.0
    randaugment: tuple[int, int] = (2, 6)  # (num_ops, magnitude)
    variants: str = "full"
    augment: str = DEFAULT_POLICY  # feast_edge.local.augment.POLICIES; True/False mean the method §7 policy / "none"
    crop_padding: int = 2  # crop-flip policies: zero padding before the random crop
    # Restricted softmax for label-skewed clients (FedRS, Li & Zhan, KDD 2021): in the training losses, the logits of
    # the classes a client holds no example of are multiplied by this factor, so its updates stop pushing those classes
    # down through weights only it trains (a top-tier variant's own slices). 1.0: method §7's plain softmax.
    absent_logit_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "randaugment", tuple(self.randaugment))
        if isinstance(self.augment, bool):  # the form older configs and messages carry
            object.__setattr__(self, "augment", DEFAULT_POLICY if self.augment else "none")
        checks = [
            (self.augment in POLICIES, f"augment = {self.augment!r} is unknown; choose one of {', '.join(POLICIES)}"),
            (0 <= self.crop_padding <= 16, f"crop_padding = {self.crop_padding} must be in 0..16"),
            (
                self.variants in VARIANT_MODES,
                f"variants = {self.variants!r} is unknown; choose one of {', '.join(VARIANT_MODES)}",
            ),
            (self.lr > 0, f"lr = {self.lr} must be > 0"),
            (0 <= self.momentum < 1, f"momentum = {self.momentum} must be in [0, 1)"),
            (self.weight_decay >= 0, f"weight_decay = {self.weight_decay} must be >= 0"),
            (self.clip_norm > 0, f"clip_norm = {self.clip_norm} must be > 0"),
            (0 <= self.kd_weight <= 1, f"kd_weight = {self.kd_weight} must be in [0, 1]"),
            (
                0 <= self.absent_logit_scale <= 1,
                f"absent_logit_scale = {self.absent_logit_scale} must be in [0, 1] (1: plain softmax)",
            ),
            (self.temperature > 0, f"temperature = {self.temperature} must be > 0"),
            (self.batch_size >= 1, f"batch_size = {self.batch_size} must be >= 1"),
            (self.epochs >= 1, f"epochs = {self.epochs} must be >= 1"),
            (self.mixup_alpha > 0 and self.cutmix_alpha > 0, "mixup_alpha and cutmix_alpha must be > 0"),
            (
                len(self.randaugment) == 2 and min(self.randaugment) >= 0,
                f"randaugment = {self.randaugment} must be (num_ops, magnitude) >= 0",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainError(f"TrainConfig: {message}")

    def settings(self) -> dict[str, object]:
        """The settings as JSON-ready values, for round messages and run fingerprints; a setting added after method §7
        is left out at its method §7 value, so that earlier agents read the message and earlier runs keep their fingerprint."""
        values = asdict(self)
        if self.absent_logit_scale == 1.0:
            del values["absent_logit_scale"]
        return values

    @property
    def uses_kd(self) -> bool:
        """Whether the small variants learn from the largest one's soft labels."""
        return self.variants in ("min+max+kd", "full")


SCHEDULES = ("cosine", "constant")


def recipe_config(recipe: Mapping[str, object], **settings: object) -> tuple[TrainConfig, str]:
    """A preset's [train] recipe with ``settings`` on top (None values skipped) -> (TrainConfig, lr schedule)."""
    merged = {**recipe, **{k: v for k, v in settings.items() if v is not None}}
    schedule = str(merged.pop("lr_schedule", "cosine"))
    if schedule not in SCHEDULES:
        raise TrainError(f"lr_schedule = {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    known = set(TrainConfig.__dataclass_fields__)
    unknown = sorted(set(merged) - known)
    if unknown:
        raise TrainError(
            f"unknown training setting(s) {', '.join(unknown)}; known: lr_schedule, {', '.join(sorted(known))}"
        )
    try:
        return TrainConfig(**merged), schedule
    except TypeError as exc:
        raise TrainError(f"a training setting has the wrong type ({exc})") from None


def preset_recipe(preset: str, overrides: Mapping[str, object] = {}, **settings: object) -> tuple[TrainConfig, str]:
    """Preset ``preset``'s [train] recipe, then ``overrides`` (``--recipe KEY=VALUE``), then the explicit ``settings`` -> (TrainConfig, lr schedule)."""
    return recipe_config({**load_preset(preset).recipe, **overrides}, **settings)


def scheduled_lr(schedule: str, base_lr: float, round_index: int, total_rounds: int) -> float:
    """Round ``round_index``'s learning rate under ``schedule`` (``cosine``: :func:`cosine_lr`; ``constant``: ``base_lr``)."""
    lr = cosine_lr(base_lr, round_index, total_rounds)  # also checks the round lies in the horizon
    return base_lr if schedule == "constant" else lr


# Rounds of one cosine cycle without a horizon: measured against 20 rounds and the constant rate (docs/benchmarks.md,
# "The learning rate of a federation without an end").
CONTINUOUS_PERIOD = 10


def continuous_lr(base_lr: float, round_index: int, period: int) -> float:
    """A learning rate without a horizon (``--continuous``): cosine decay over ``period`` rounds, restarted at its
    peak (SGDR, Loshchilov & Hutter 2017): ``base·(1 + cos(π·(t mod P)/P))/2``; ``period`` 0: ``base`` throughout."""
    if round_index < 0:
        raise TrainError(f"round {round_index} is negative")
    return base_lr if period <= 0 else cosine_lr(base_lr, round_index % period, period)


def cosine_lr(base_lr: float, round_index: int, total_rounds: int) -> float:
    """Cosine decay over the federation horizon: ``base·(1 + cos(π·t/T))/2`` for round ``t`` of ``T`` (method §7)."""
    if total_rounds < 1 or not 0 <= round_index < total_rounds:
        raise TrainError(f"round {round_index} is outside the federation horizon 0..{total_rounds - 1}")
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * round_index / total_rounds))
