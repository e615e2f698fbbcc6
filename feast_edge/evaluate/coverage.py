"""Class coverage of a label-skewed fleet, and the serving rule that uses the federation's validation.

In FEAST a variant's parameters are trained only by the devices whose budget admits it (method §4-§5), so a class
that only small devices hold never reaches the weights exclusive to the large variants. From the per-class example
counts the devices register (counts only), the server knows, per variant:

* ``trained``: the classes held by the devices that can train it (budget >= its MACs);
* ``validated``: the classes of the held-out splits of the devices that can evaluate it (``evaluate_macs``, which a
  device may set above its serving budget: evaluation is a one-off, not serving);
* ``calibrated``: the classes of the devices whose BN statistics it was given (reported by the calibration).

The serving rule (:func:`serving_choice`): a device gets its largest affordable variant, unless a smaller affordable
one is better on the federation's validation by more than ``SERVE_MARGIN`` and than two standard errors of the
difference (the variant it would get may have been trained on fewer classes than the smaller ones).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SERVE_MARGIN = 0.02  # validation accuracy a smaller variant must gain over the largest affordable one, at least
SERVE_Z = 2.0  # ... and this many standard errors of the difference, where the examples behind the figures are known
SERVING_RULES = ("validated", "largest")  # feast-server run --serving-rule
LARGEST = "largest affordable"
NOT_VALIDATED = "largest affordable (not validated)"
LARGEST_BY_SETTING = "largest affordable (--serving-rule largest)"


@dataclass(frozen=True)
class Holder:
    """What one registered device holds and can run: budget, evaluation limit, per-class example counts."""

    device: str
    budget_macs: int
    evaluate_macs: int  # the largest variant (MACs) it may evaluate and calibrate; at least budget_macs
    class_counts: tuple[int, ...] = ()  # training examples per class, in the task's order; () when not registered
    holdout_counts: tuple[int, ...] = ()  # held-out examples per class; () when not registered

    @property
    def known(self) -> bool:
        """Whether the device registered its per-class counts (agents before this release did not)."""
        return bool(self.class_counts)

    def classes(self) -> frozenset[int]:
        return frozenset(k for k, n in enumerate(self.class_counts) if n > 0)

    def holdout_classes(self) -> frozenset[int]:
        return frozenset(k for k, n in enumerate(self.holdout_counts) if n > 0)


def holder_of(device: str, budget_macs: int, profile: Mapping[str, object]) -> Holder:
    """A registry row's :class:`Holder` (the server keeps the counts in the registered profile)."""

    def counts(key: str) -> tuple[int, ...]:
        value = profile.get(key)
        return tuple(int(n) for n in value) if isinstance(value, (list, tuple)) else ()

    evaluate = profile.get("evaluate_macs")
    return Holder(
        device,
        int(budget_macs),
        max(int(budget_macs), int(evaluate) if isinstance(evaluate, int) else 0),
        counts("class_counts"),
        counts("holdout_counts"),
    )


@dataclass(frozen=True)
class VariantCoverage:
    """Which classes reached one variant: trained on, validated on, BN-calibrated on (indices into the task's classes)."""

    macs: int
    classes: int  # the task's number of classes
    trained: frozenset[int]
    trained_by: tuple[str, ...]
    validated: frozenset[int]
    validated_by: tuple[str, ...]
    calibrated: frozenset[int] | None = None  # None: not calibrated on the devices (or not yet)
    calibrated_by: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()  # devices that can train it but registered no per-class counts

    def to_dict(self, names: Sequence[str]) -> dict[str, object]:
        """JSON-ready: for each of trained / validated / calibrated, the class names covered, the missing and by whom."""

        def part(covered: frozenset[int] | None, by: tuple[str, ...]) -> dict[str, object] | None:
            if covered is None:
                return None
            return {
                "classes": [names[k] for k in sorted(covered)],
                "missing": [names[k] for k in range(self.classes) if k not in covered],
                "devices": list(by),
            }

        return {
            "macs": self.macs,
            "trained": part(self.trained, self.trained_by),
            "validated": part(self.validated, self.validated_by),
            "calibrated": part(self.calibrated, self.calibrated_by),
            "unknown": list(self.unknown),
        }


def _union(sets: Iterable[frozenset[int]]) -> frozenset[int]:
    out: frozenset[int] = frozenset()
    for s in sets:
        out |= s
    return out


def variant_coverage(
    holders: Sequence[Holder], macs: int, classes: int, calibrated_by: Sequence[str] | None = None
) -> VariantCoverage:
    """The coverage of the variant of ``macs`` MACs over ``holders`` (``calibrated_by``: who gave its BN statistics)."""
    trainers = [h for h in holders if h.budget_macs >= macs]
    testers = [h for h in holders if h.evaluate_macs >= macs and any(h.holdout_counts)]
    by_id = {h.device: h for h in holders}
    calibrators = None if calibrated_by is None else [by_id[d] for d in calibrated_by if d in by_id]
    return VariantCoverage(
        macs=int(macs),
        classes=classes,
        trained=_union(h.classes() for h in trainers),
        trained_by=tuple(sorted(h.device for h in trainers)),
        validated=_union(h.holdout_classes() for h in testers),
        validated_by=tuple(sorted(h.device for h in testers)),
        calibrated=None if calibrators is None else _union(h.classes() for h in calibrators),
        calibrated_by=() if calibrators is None else tuple(sorted(h.device for h in calibrators)),
        unknown=tuple(sorted(h.device for h in trainers if not h.known)),
    )


def class_list(indices: Iterable[int], names: Sequence[str], limit: int = 6) -> str:
    """``two, three, four`` (at most ``limit`` names, then ``and N more``)."""
    shown = [names[k] for k in sorted(indices)]
    if len(shown) <= limit:
        return ", ".join(shown)
    return f"{', '.join(shown[:limit])} and {len(shown) - limit} more"


def coverage_words(covered: frozenset[int] | None, classes: int, names: Sequence[str]) -> str:
    """``all 10 classes``, ``7 of 10 (missing two, three, four)``, or ``-`` when unknown."""
    if covered is None:
        return "-"
    if len(covered) == classes:
        return f"all {classes} classes"
    missing = [k for k in range(classes) if k not in covered]
    return f"{len(covered)} of {classes} (missing {class_list(missing, names)})"


def coverage_warnings(holders: Sequence[Holder], served_macs: Iterable[int], names: Sequence[str]) -> list[str]:
    """One line per problem of a label-skewed fleet: classes no device holds, single-class devices, and served variants
    trained or validated on fewer than all classes. Devices without per-class counts are left out (and said so)."""
    known = [h for h in holders if h.known]
    classes = len(names)
    lines = []
    if not known:
        return lines
    nobody = [k for k in range(classes) if not any(k in h.classes() for h in known)]
    if nobody:
        lines.append(
            f"no registered device holds class{'es' if len(nobody) > 1 else ''} {class_list(nobody, names)}: "
            "no model of this federation can learn to recognise it"
        )
    for h in known:
        if len(h.classes()) == 1:
            (only,) = h.classes()
            lines.append(
                f"{h.device} holds one class only ({names[only]}): its updates teach the model to answer "
                f"{names[only]} whatever it sees"
            )
    for macs in sorted(set(served_macs)):
        cov = variant_coverage(holders, macs, classes)
        gaps = [k for k in range(classes) if k not in cov.trained and k not in nobody]
        if gaps:
            lines.append(
                f"variant {macs / 1e6:.2f}M MACs is trained only by {', '.join(cov.trained_by)}, on "
                f"{len(cov.trained)} of {classes} classes (missing {class_list(gaps, names)}): its own weights "
                "never see those classes"
            )
        unseen = [k for k in range(classes) if k not in cov.validated and k not in nobody]
        if cov.validated_by and unseen:
            lines.append(
                f"variant {macs / 1e6:.2f}M MACs is validated on {len(cov.validated)} of {classes} classes "
                f"(missing {class_list(unseen, names)}; devices that can evaluate it: {', '.join(cov.validated_by)})"
            )
    unknown = sorted(h.device for h in holders if not h.known)
    if unknown:
        lines.append(
            f"{', '.join(unknown)} registered no per-class counts (an older feast-agent): coverage leaves them out"
        )
    return lines


@dataclass(frozen=True)
class Serving:
    """The variant a device is served (its index in the cache) and the rule that chose it."""

    index: int
    macs: int
    rule: str  # LARGEST, NOT_VALIDATED, or "better on validation: 91.2% vs 68.8% for the 7.06M variant"
    largest_macs: int
    accuracy: float | None = None  # the served variant's validation accuracy, where validated


def required_gain(top: float, other: float, n_top: int | None, n_other: int | None, margin: float) -> float:
    """How much ``other`` must beat ``top`` by: ``margin``, or SERVE_Z standard errors of the difference of two
    accuracies measured on ``n_top`` and ``n_other`` examples when both are known (binomial; no variant is swapped
    for another on a difference that the held-out splits' size cannot tell from noise)."""
    if not n_top or not n_other:
        return margin
    variance = top * (1 - top) / n_top + other * (1 - other) / n_other
    return max(margin, SERVE_Z * math.sqrt(max(variance, 1e-12)))


def serving_choice(
    affordable: Sequence[tuple[int, int]],
    validation: Mapping[int, float],
    examples: Mapping[int, int] | None = None,
    margin: float = SERVE_MARGIN,
) -> Serving:
    """Among the ``affordable`` variants ((cache index, MACs), sorted by MACs), the largest, unless a smaller one with
    a validation accuracy in ``validation`` (cache index -> accuracy) beats the largest's by more than
    :func:`required_gain` (``examples``: cache index -> held-out examples behind the figure); then the best of those
    (the larger among ties)."""
    if not affordable:
        raise ValueError("serving_choice: no affordable variant")
    examples = examples or {}
    largest, largest_macs = affordable[-1]
    if largest not in validation:
        return Serving(largest, largest_macs, NOT_VALIDATED, largest_macs)
    top = validation[largest]
    better = [
        (i, m)
        for i, m in affordable[:-1]
        if i in validation
        and validation[i] - top > required_gain(top, validation[i], examples.get(largest), examples.get(i), margin)
    ]
    if not better:
        return Serving(largest, largest_macs, LARGEST, largest_macs, top)
    best, macs = max(better, key=lambda im: (validation[im[0]], im[1]))
    rule = (
        f"better on validation: {100 * validation[best]:.1f}% vs {100 * top:.1f}% for the "
        f"{largest_macs / 1e6:.2f}M variant"
    )
    return Serving(best, macs, rule, largest_macs, validation[best])
