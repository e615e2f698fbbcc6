"""A run's differential-privacy settings and their one check (``--dp-*``; docs/privacy.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from feast_edge.errors import FeastError

MODES = ("central", "local")
DEFAULT_DELTA = 1e-5  # at most; below 1/population always (default_delta)
AGGREGATIONS = ("mean",)  # the sensitivity bound holds for the sum of clipped updates; robust rules are no sums
# Adaptive clipping (Andrew et al. 2021): the defaults of the paper and of Flower's adaptive-clipping strategies.
CLIP_LR = 0.2
COUNT_SHARE = 0.1  # default share of the privacy (1/z², the Gaussian's precision) spent on the clipped count


class PrivacyError(FeastError, ValueError):
    """Differential-privacy settings that cannot give the stated guarantee."""


@dataclass(frozen=True)
class DpSettings:
    """Client-level DP: every update clipped to L2 norm ``clip``; Gaussian noise ``noise`` x ``clip`` per coordinate sum.

    ``mode``: ``central`` (the server adds the noise to each coordinate's sum: trusts the server) or ``local`` (each
    client noises its own clipped update before it leaves: trusts nobody, costs accuracy). ``delta``: the δ of the
    reported ε (None: :func:`default_delta` of the population). ``epsilon``: the budget a run may not exceed (None:
    none). ``seed``: the noise generator's seed (None: drawn from the OS every round, not reproducible; tests only).

    Adaptive clipping (``clip_quantile`` set; central DP only): ``clip`` is the first round's bound, and after each
    round the bound moves geometrically toward the ``clip_quantile`` of the update norms, ``C ← C·exp(−clip_lr·(b̃ −
    γ))``, where ``b̃`` is the noised fraction of updates within the bound (noise std ``clip_count_std`` on the count;
    None: :data:`COUNT_SHARE` of the privacy). The updates' noise grows to keep the total at ``noise``
    (:meth:`update_noise`), so ε is the same as with a fixed bound.
    """

    clip: float
    noise: float
    delta: float | None = None
    epsilon: float | None = None
    seed: int | None = None
    mode: str = "central"
    clip_quantile: float | None = None
    clip_lr: float = CLIP_LR
    clip_count_std: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise PrivacyError(f"--dp-clip {self.clip!r} must be a positive L2 norm, e.g. --dp-clip 1.0")
        if not (isinstance(self.noise, (int, float)) and math.isfinite(self.noise) and self.noise > 0):
            raise PrivacyError(
                f"--dp-noise {self.noise!r} must be a positive noise multiplier z (noise std = z x clip), e.g. 1.0; "
                "to train without privacy leave out --dp-clip and --dp-noise"
            )
        if self.delta is not None and not (0 < self.delta < 1):
            raise PrivacyError(f"--dp-delta {self.delta!r} must lie in (0, 1), and below 1/population, e.g. 1e-5")
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise PrivacyError(f"--dp-epsilon {self.epsilon!r} must be a positive privacy budget, e.g. 8")
        if self.mode not in MODES:
            raise PrivacyError(f"--dp-mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.clip_quantile is not None:
            self._check_adaptive()

    def _check_adaptive(self) -> None:
        if not (isinstance(self.clip_quantile, (int, float)) and 0 < self.clip_quantile < 1):
            raise PrivacyError(
                f"--dp-clip-quantile {self.clip_quantile!r} must be a fraction in (0, 1): the share of updates the "
                "adaptive bound should leave unclipped, e.g. 0.5 (the median norm)"
            )
        if not (isinstance(self.clip_lr, (int, float)) and math.isfinite(self.clip_lr) and self.clip_lr > 0):
            raise PrivacyError(f"--dp-clip-lr {self.clip_lr!r} must be a positive step of the bound's log, e.g. 0.2")
        if self.mode == "local":
            raise PrivacyError(
                "--dp-clip-quantile works with --dp-mode central only: the adaptive bound needs each update's "
                "clipped-or-not bit at the server, which local DP does not send; use a fixed --dp-clip"
            )
        std = self.clip_count_std
        if std is not None and not (isinstance(std, (int, float)) and math.isfinite(std) and std > self.noise / 2):
            raise PrivacyError(
                f"--dp-clip-count-std {std!r} must exceed --dp-noise / 2 = {self.noise / 2:g}: the count's noise takes "
                f"its share of the privacy from the updates', and at or below z/2 it would take all of it; leave it out "
                f"for the default {self.count_std():.3g}"
            )

    @property
    def adaptive(self) -> bool:
        return self.clip_quantile is not None

    def count_std(self) -> float:
        """Std of the noise on the count of unclipped updates (adaptive clipping): given, or COUNT_SHARE of 1/z²."""
        return self.clip_count_std if self.clip_count_std is not None else self.noise / (2 * math.sqrt(COUNT_SHARE))

    def update_noise(self) -> float:
        """The updates' noise multiplier: ``noise``, or under adaptive clipping ``(z⁻² − (2σ_b)⁻²)^(−1/2)`` so that the
        count (sensitivity 1/2 as ``Σ(b_i − ½)``) and the updates together are one Gaussian mechanism of multiplier z."""
        if not self.adaptive:
            return self.noise
        return (self.noise**-2 - (2 * self.count_std()) ** -2) ** -0.5

    def resolved_delta(self, population: int) -> float:
        """δ for a population of ``population`` clients: the given one, checked to be below 1/population, or the default."""
        if self.delta is None:
            return default_delta(population)
        if self.delta >= 1 / population:
            raise PrivacyError(
                f"--dp-delta {self.delta:g} is not below 1/population = 1/{population}: a mechanism that publishes one "
                f"client's whole update with probability δ would satisfy it; use at most {default_delta(population):.2g}"
            )
        return self.delta

    def settings(self) -> dict[str, Any]:
        """What a run's fingerprint records (a resume with other DP settings is refused)."""
        dp = {
            "clip": self.clip,
            "noise": self.noise,
            "delta": self.delta,
            "epsilon": self.epsilon,
            "seed": self.seed,
            "mode": self.mode,
        }
        if self.adaptive:  # a run with a fixed bound keeps the fingerprint it had before adaptive clipping existed
            dp |= {"clip_quantile": self.clip_quantile, "clip_lr": self.clip_lr, "clip_count_std": self.clip_count_std}
        return {"dp": dp}


def default_delta(population: int) -> float:
    """The default δ: 1e-5, or 0.1/population where that is smaller (δ must stay well below 1/population)."""
    return min(DEFAULT_DELTA, 0.1 / max(1, population))


def check_composes(aggregation: str, private_aggregation: bool, method: str) -> None:
    """Refuse the aggregations DP cannot bound: robust rules (not sums) and methods that do not average routed slices.

    Every server optimizer composes: it steps from the noised aggregate, which is post-processing."""
    if aggregation not in AGGREGATIONS:
        raise PrivacyError(
            f"--aggregation {aggregation} does not compose with differential privacy: the noise is calibrated to the "
            "sum of clipped updates, and a trimmed mean, median or adaptive clip is not that sum; use --aggregation "
            "mean (the clipping bounds every device's influence already)"
        )
    if not private_aggregation:
        raise PrivacyError(
            f"method {method} does not aggregate by averaging routed slices, so the per-coordinate noise cannot be "
            "calibrated to it; DP runs with feast, heterofl or scalefl"
        )


def dp_of(owner: Any) -> DpSettings | None:
    """The DP settings of a run configuration's ``dp_clip``, ``dp_noise``, ``dp_delta``, ``dp_epsilon``, ``dp_seed`` and
    ``dp_mode`` and ``dp_clip_*`` fields (``--dp-*``): None without DP, a :class:`PrivacyError` naming the options
    that do not fit."""
    adaptive = ("clip_quantile", "clip_lr", "clip_count_std")
    if owner.dp_clip is None and owner.dp_noise is None:
        given = [
            f"--dp-{k.replace('_', '-')}"
            for k in ("delta", "epsilon", "seed", *adaptive)
            if getattr(owner, f"dp_{k}") not in (None, CLIP_LR)
        ]
        given += ["--dp-mode"] if owner.dp_mode != "central" else []
        if given:
            raise PrivacyError(f"{', '.join(given)} needs --dp-clip and --dp-noise (without them there is no DP)")
        return None
    if owner.dp_clip is None or owner.dp_noise is None:
        raise PrivacyError(
            "differential privacy needs both --dp-clip C and --dp-noise z, e.g. --dp-clip 1 --dp-noise 1"
        )
    if owner.dp_clip_quantile is None and (owner.dp_clip_lr != CLIP_LR or owner.dp_clip_count_std is not None):
        raise PrivacyError("--dp-clip-lr and --dp-clip-count-std tune adaptive clipping: they need --dp-clip-quantile")
    return DpSettings(
        owner.dp_clip,
        owner.dp_noise,
        owner.dp_delta,
        owner.dp_epsilon,
        owner.dp_seed,
        owner.dp_mode,
        owner.dp_clip_quantile,
        owner.dp_clip_lr,
        owner.dp_clip_count_std,
    )
