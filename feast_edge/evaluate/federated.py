"""Evaluation where the data lives (method §8 on the devices): a server that holds no data validates and calibrates this way.

    device:  held_out_counts(routed sub-supernet, probes, its training split, its held-out split)
               each probe extracted, BN recalibrated on ``calibration`` training examples (a fixed, seeded
               sample: files sorted by class would describe one class), tested on the held-out split
    server:  combine_counts(every device's counts) -> per probe Σ correct / Σ total (sample-weighted)
             federated_accuracy(...) -> the mean over the probes some device tested: the round's validation accuracy

    device:  calibrated_static(served variant's weights, its training split) -> the model its ONNX file holds

The same recalibration as the server-held protocol (``evaluation.calibrated_variant``), only on each
device's own examples; no example leaves the device, only counts do.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from feast_edge.aggregate.weights import weight_cap
from feast_edge.evaluate.evaluation import calibrated_variant, correct_count, pixel_batches
from feast_edge.route.plans import ClientPlan
from feast_edge.space.arch import Arch
from feast_edge.space.extract import recalibrate_bn
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet

CALIBRATION = (
    500  # training examples a device recalibrates BN on by default (the server-held protocol's --calib-samples)
)


def calibration_subset(
    images: torch.Tensor, count: int, labels: torch.Tensor | None = None, seed: int = 0
) -> torch.Tensor:
    """``count`` of a device's training ``images`` for BN recalibration, in a fixed, seeded order.

    With ``labels``, class-balanced: each of the ``k`` classes present gives ``count // k`` examples (drawn without
    replacement where it has that many, with replacement where it has fewer), so the BN statistics describe the
    device's classes as if they were equally frequent, as the served task's classes are assumed to be. A device's
    data is skewed (non-IID): on the demo's Dirichlet shards this recalibration lifted the small devices' test
    accuracy from 66-68 % to 71-72 % against the device's own class frequencies (docs/benchmarks.md). Without
    ``labels``, a seeded random sample (a device's files are often sorted by class: its first ``count`` would
    describe one or two classes).
    """
    generator = torch.Generator().manual_seed(seed)
    if labels is None or labels.numel() == 0:
        order = torch.randperm(int(images.shape[0]), generator=generator)
        return images[order[:count]]
    classes = torch.unique(labels)
    quota = max(1, count // len(classes))
    picks = []
    for c in classes.tolist():
        members = (labels == c).nonzero().flatten()
        if len(members) >= quota:
            picks.append(members[torch.randperm(len(members), generator=generator)[:quota]])
        else:
            picks.append(members[torch.randint(len(members), (quota,), generator=generator)])
    index = torch.cat(picks)
    return images[index[torch.randperm(len(index), generator=generator)]]


def routed_supernet(preset: Preset, plan: ClientPlan, routed_state: Mapping[str, torch.Tensor]) -> Supernet:
    """The routed sub-supernet of ``plan`` holding ``routed_state`` (what a device trains, here to evaluate)."""
    model = Supernet(preset, classes=preset.classes, layout=plan.layout(preset, preset.classes), seed=None)
    model.load_state_dict(routed_state)
    return model


def held_out_counts(
    supernet: Supernet,
    probes: Sequence[Arch],
    train_images: torch.Tensor,
    holdout_images: torch.Tensor,
    holdout_labels: torch.Tensor,
    calibration: int = CALIBRATION,
    device: str | torch.device = "cpu",
    train_labels: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """(correct, total) of every probe on the held-out split, each BN-recalibrated on the training split first (method §8)."""
    total = int(holdout_labels.shape[0])
    if total == 0 or train_images.shape[0] == 0:
        return [(0, 0) for _ in probes]
    calibration_images = calibration_subset(train_images, calibration, train_labels)
    counts = []
    for arch in probes:
        model = calibrated_variant(supernet, arch, calibration_images, device=device)
        counts.append((correct_count(model, holdout_images, holdout_labels, supernet.preset, device=device), total))
    return counts


def combine_counts(reports: Iterable[Sequence[tuple[int, int]]], probes: int) -> list[tuple[int, int]]:
    """Per probe, Σ correct and Σ total over the devices' reports (each lists one pair per probe)."""
    combined = [(0, 0)] * probes
    for counts in reports:
        combined = [(c + dc, n + dn) for (c, n), (dc, dn) in zip(combined, counts)]
    return combined


VAL_RULES = ("median", "pooled")
DEFAULT_VAL_RULE = "median"
MIN_SELECTING = 3  # devices whose validation must agree (a median of 3 or more) before it may choose the served round
# A device whose accuracy sits this far (absolute) from the others' median, and beyond their own spread, is named.
FLAG = 0.3


@dataclass(frozen=True)
class Validated:
    """A round's federated validation: per probe the figure, and what the devices' figures were worth.

    ``selects``: whether the figure is the median of at least MIN_SELECTING devices, which no single device moves
    outside the honest devices' range (with ``pooled``: any figure). The served round is chosen apart from it, by each
    device's figure on its served variant (feast_edge.evaluate.served_round).
    ``flagged``: device -> why its figures disagree in a way its classes cannot explain (its report may be false).
    """

    points: list[float | None]
    devices: int
    selects: bool
    flagged: dict[str, str]
    selecting: float | None = None  # the figure that chooses: the mean over the probes enough devices tested
    differs: dict[str, str] = field(default_factory=dict)  # device -> the disagreement its class mix explains

    @property
    def accuracy(self) -> float | None:
        """The round's figure: the one that chooses where there is one, else the mean over the probes tested."""
        if self.selecting is not None:
            return self.selecting
        tested = [p for p in self.points if p is not None]
        return sum(tested) / len(tested) if tested else None


def capped_counts(
    reports: Mapping[str, Sequence[tuple[int, int]]], ratio: float
) -> dict[str, list[tuple[float, float]]]:
    """Each device's (correct, total) per probe scaled so that its total weighs at most ``ratio`` times the lower median
    of the devices' totals (``feast_edge.aggregate.weights``); 0: as reported."""
    totals = {d: max((n for _, n in counts), default=0) for d, counts in reports.items()}
    cap = weight_cap([n for n in totals.values() if n > 0], ratio) if any(totals.values()) else None
    out = {}
    for device, counts in reports.items():
        scale = 1.0 if cap is None or totals[device] <= cap else cap / totals[device]
        out[device] = [(c * scale, n * scale) for c, n in counts]
    return out


def robust_validation(
    reports: Mapping[str, Sequence[tuple[int, int]]],
    probes: int,
    rule: str = DEFAULT_VAL_RULE,
    max_weight_ratio: float = 8.0,
    mixes: Mapping[str, Sequence[int]] | None = None,
) -> Validated:
    """Per probe, the devices' held-out accuracies combined by ``rule``: ``median`` (each device one vote; the default)
    or ``pooled`` (Σ correct / Σ total, each device's total capped at ``max_weight_ratio`` lower medians).
    ``mixes``: each device's held-out examples per class (what it registered), which may explain a disagreement."""
    if rule not in VAL_RULES:
        raise ValueError(f"--val-rule {rule!r} is unknown; choose one of {', '.join(VAL_RULES)}")
    testers = [sum(1 for counts in reports.values() if counts[k][1] > 0) for k in range(probes)]
    answered = [d for d, counts in reports.items() if any(n > 0 for _, n in counts)]
    if rule == "pooled":
        pooled = combine_counts(capped_counts(reports, max_weight_ratio).values(), probes)
        points = [c / n if n > 0 else None for c, n in pooled]
    else:
        points = []
        for k in range(probes):
            rates = sorted(counts[k][0] / counts[k][1] for counts in reports.values() if counts[k][1] > 0)
            points.append(statistics.median(rates) if rates else None)
    flagged, differs = disagreements(reports, probes, mixes or {})
    if rule == "pooled":  # the user's choice to trust the devices' counts (capped): it selects as server data would
        return Validated(points, len(answered), bool(answered), flagged, differs=differs)
    # A probe fewer than MIN_SELECTING devices tested (a large variant few can run) has a median two devices decide:
    # the figure that chooses the served round is the mean over the probes enough devices tested.
    decided = [p for p, n in zip(points, testers) if p is not None and n >= MIN_SELECTING]
    if decided:
        return Validated(points, len(answered), True, flagged, sum(decided) / len(decided), differs)
    return Validated(points, len(answered), False, flagged, differs=differs)


def class_distance(mix: Sequence[int], others: Sequence[int]) -> float:
    """Total-variation distance between two class mixes (examples per class): an upper bound on how far any model's
    accuracy can differ between them (|Σ (p_k - q_k) a_k| <= TV for per-class accuracies a_k in [0, 1])."""
    a, b = sum(mix), sum(others)
    if not a or not b or len(mix) != len(others):
        return 0.0
    return 0.5 * sum(abs(x / a - y / b) for x, y in zip(mix, others))


def accuracy_range(mix: Sequence[int], other: Sequence[int], accuracy: float) -> tuple[float, float]:
    """The accuracies a model can have on class mix ``mix`` when it has ``accuracy`` on class mix ``other``: the least
    and the most of Σ p_k a_k over per-class accuracies a_k in [0, 1] with Σ q_k a_k = ``accuracy`` (p, q the two mixes
    as shares). A linear programme solved greedily (a fractional knapsack): for the most, a_k = 1 on the classes only
    ``mix`` holds, then the other's accuracy spent on the classes where p_k / q_k is largest; for the least, the
    reverse. Tighter than :func:`class_distance`, which ignores the other device's level."""
    a, b = sum(mix), sum(other)
    if not a or not b or len(mix) != len(other):
        return 0.0, 1.0
    p, q = [x / a for x in mix], [y / b for y in other]
    shared = sorted((k for k in range(len(p)) if q[k] > 0), key=lambda k: p[k] / q[k])
    only_mine = sum(pk for pk, qk in zip(p, q) if qk == 0)

    def spend(order: Sequence[int]) -> float:
        left, total = accuracy, 0.0
        for k in order:
            share = min(1.0, left / q[k])
            total, left = total + share * p[k], left - share * q[k]
            if left <= 0:
                break
        return total

    return spend(shared), only_mine + spend(shared[::-1])


def binomial_se(accuracy: float, examples: int) -> float:
    """A standard error of an accuracy measured on ``examples`` that is not 0 at 0 % or 100 % (Agresti-Coull's
    add-two-successes-and-two-failures estimate of the rate)."""
    rate = (accuracy * examples + 2) / (examples + 4)
    return math.sqrt(rate * (1 - rate) / (examples + 4))


def disagreements(
    reports: Mapping[str, Sequence[tuple[int, int]]], probes: int, mixes: Mapping[str, Sequence[int]]
) -> tuple[dict[str, str], dict[str, str]]:
    """The devices whose held-out accuracy sits more than FLAG (and 3 median deviations) from the other devices' median,
    on the probes every device tested: (those their class mix cannot explain, those it can).

    Two honest devices testing the same model can differ only as far as their held-out class mixes allow given what
    each measured (:func:`accuracy_range`: the same per-class accuracies behind both figures), plus sampling noise (two
    standard errors of each figure). A device's gap is explained by its classes when that holds against at least half
    of the other devices, one by one: beside a liar, an honest device still agrees with the other honest ones, so a
    liar cannot get it called false.
    """
    common = [k for k in range(probes) if all(counts[k][1] > 0 for counts in reports.values())] or range(probes)
    sums = {d: [(c, n) for k, (c, n) in enumerate(counts) if k in common and n > 0] for d, counts in reports.items()}
    means = {d: sum(c / n for c, n in v) / len(v) for d, v in sums.items() if v}
    examples = {d: max((n for _, n in sums[d]), default=0) for d in means}
    flagged: dict[str, str] = {}
    differs: dict[str, str] = {}
    if len(means) < MIN_SELECTING:
        return flagged, differs

    def consistent(a: str, b: str) -> bool:
        slack_b = 2 * binomial_se(means[b], examples[b])
        low, _ = accuracy_range(mixes[a], mixes[b], max(0.0, means[b] - slack_b))
        _, high = accuracy_range(mixes[a], mixes[b], min(1.0, means[b] + slack_b))
        slack_a = 2 * binomial_se(means[a], examples[a])
        return low - slack_a <= means[a] <= high + slack_a

    for device, mean in means.items():
        others = [m for d, m in means.items() if d != device]
        middle = statistics.median(others)
        spread = statistics.median(abs(m - middle) for m in others)
        if abs(mean - middle) <= max(FLAG, 3 * spread):
            continue
        said = f"its held-out accuracy {100 * mean:.1f}% is far from the other devices' median {100 * middle:.1f}%"
        mix = mixes.get(device)
        peers = [d for d in means if d != device and mixes.get(d)]
        if not mix or not peers:  # no class counts registered (an older agent): nothing tells the two apart
            flagged[device] = f"{said} (its data differs from theirs, or its report is false)"
        elif 2 * sum(consistent(device, d) for d in peers) >= len(peers):
            held = sum(1 for n in mix if n > 0)
            pooled = [sum(col) for col in zip(*(mixes[d] for d in peers))]
            mine = (
                f"it holds {held} of {len(mix)}"
                if held < len(mix)
                else f"its mix is {class_distance(mix, pooled):.2f} from theirs"
            )
            differs[device] = f"its classes differ: {mine} ({said})"
        else:
            flagged[device] = f"{said}: its class mix cannot explain the gap, its report may be false"
    return flagged, differs


def federated_accuracy(combined: Sequence[tuple[int, int]]) -> float | None:
    """Mean over the probes some device tested of their sample-weighted accuracy; None when none was tested."""
    tested = [c / n for c, n in combined if n > 0]
    return sum(tested) / len(tested) if tested else None


def calibrated_static(
    model: StaticResNet,
    preset: Preset,
    images: torch.Tensor,
    calibration: int = CALIBRATION,
    batch_size: int = 100,
    labels: torch.Tensor | None = None,
) -> int:
    """Recalibrate a served variant's BN on ``calibration`` of ``images`` (a device's training split, chosen by
    :func:`calibration_subset`, class-balanced with ``labels``); returns how many examples it saw."""
    subset = calibration_subset(images, calibration, labels)
    return recalibrate_bn(model, pixel_batches(subset, preset, batch_size))
