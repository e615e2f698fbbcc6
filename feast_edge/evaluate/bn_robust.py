"""Federated BN statistics one device cannot steer: capped weights, a robust centre, and reports screened against it.

A served variant's BN statistics are the devices' per-channel moments combined (``bn_stats.combine_statistics``,
method §8). The devices are provisioned but may lie: finite means of 10⁶, variances of 0, moments shifted by 3σ, a
claimed weight of 10⁶ examples. Each moves the exact mixture anywhere, and with it every device's served model.
The rules (``feast-server run --bn-rule``):

    weights  w_i = min(n_i, cap)  with  cap = r · lower median(n)      r = --max-weight-ratio (feast_edge.aggregate.weights)
    mixture  the weighted mixture of every report (law of total variance): exact, steered by any one device
    median   per channel, one vote per device: μ* = median of μ_i,  v* = median of σ_i² + (μ_i - μ*)²
    screened (default) per report and BN layer, against the centre of all reports (μ*, and s* = median of σ_i²,
             one vote per device: a claimed weight buys nothing here):
                 shift  = median over channels of |μ_i - μ*| / √s*
                 spread = median over channels of |ln(σ_i² / s*)|
             a report with shift > SHIFT or spread > SPREAD in any layer is refused, and the rest are mixed exactly

``screened`` serves the exact mixture of the honest reports, so an honest run costs nothing (the honest devices' moments
sit well inside the bounds, bench/bench_robust_bn.py); it needs a majority to tell who is out of line:

    3 or more reports   the centre is a median over devices: it stays inside the honest reports' range while the
                        liars are fewer than half the devices, so they are refused and named
    2 reports           no majority: if they disagree beyond the bounds, neither is used (the devices the variant is
                        served to calibrate it on their own data, and say so); if they agree, they are mixed
    1 report            nothing to check against: used as it is (it is then mostly that device's own variant; the
                        device compares it with its own recalibration before keeping it, feast_edge.agent.on_device)

A refused report is named with its reason; if half the devices or more are refused, the variant gets no federated
statistics at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from feast_edge.aggregate.weights import weight_cap
from feast_edge.evaluate.bn_stats import Stats, combine_statistics

BN_RULES = ("screened", "median", "mixture")
DEFAULT_BN_RULE = "screened"
SHIFT = 1.5  # the most a report's typical channel mean may sit from the centre, in the centre's standard deviations
SPREAD = math.log(3.0)  # the most a report's typical channel variance may differ from the centre's, as a log ratio
_EPS = 1e-5  # BatchNorm's own epsilon: variances below it are indistinguishable to the layer


@dataclass(frozen=True)
class Report:
    """One device's statistics of one variant, and the examples it says they describe (its registered samples)."""

    device: str
    weight: float
    stats: Stats


@dataclass(frozen=True)
class Combined:
    """What a rule made of the reports: the statistics (None: none usable), who was used and who refused, and why."""

    stats: Stats | None
    used: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)
    note: str = ""


def check_bn_rule(rule: str) -> None:
    if rule not in BN_RULES:
        raise ValueError(f"--bn-rule {rule!r} is unknown; choose one of {', '.join(BN_RULES)}")


def capped(reports: Sequence[Report], ratio: float) -> list[float]:
    """Each report's weight, capped at ``ratio`` times the lower median of the reports' weights (0: uncapped)."""
    cap = weight_cap([max(1, int(r.weight)) for r in reports], ratio)
    return [float(r.weight if cap is None else min(r.weight, cap)) for r in reports]


def weighted_median(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per column of ``values`` [n, C], the lower weighted median (the smallest value holding half the weight)."""
    order = values.argsort(dim=0)
    ranked = values.gather(0, order)
    cumulative = weights[order].cumsum(0)
    half = weights.sum() / 2
    index = (cumulative < half - 1e-12 * weights.sum()).sum(0, keepdim=True).clamp_max(values.shape[0] - 1)
    return ranked.gather(0, index).squeeze(0)


def median_statistics(stats: Sequence[Stats]) -> Stats:
    """Per channel, the median mean over the devices and the median second moment about it (one vote per device)."""
    w = torch.ones(len(stats), dtype=torch.float64)
    out: Stats = {}
    for name in stats[0]:
        means = torch.stack([s[name][0] for s in stats])
        centre = weighted_median(means, w)
        second = torch.stack([s[name][1] + (s[name][0] - centre) ** 2 for s in stats])
        out[name] = (centre, weighted_median(second, w))
    return out


def deviation(stats: Stats, centre: Stats, spread: Stats) -> tuple[float, float, str]:
    """(shift, spread, layer) of ``stats`` against the centre's means and within-device variances: the largest over the
    BN layers of the median over channels (see the module's docstring)."""
    worst = (0.0, 0.0, "")
    for name, (mean, var) in stats.items():
        scale = spread[name][1].clamp_min(_EPS)
        shift = float(((mean - centre[name][0]).abs() / scale.sqrt()).median())
        ratio = float((var.clamp_min(_EPS) / scale).log().abs().median())
        if max(shift / SHIFT, ratio / SPREAD) > max(worst[0] / SHIFT, worst[1] / SPREAD):
            worst = (shift, ratio, name)
    return worst


def centre(stats: Sequence[Stats]) -> tuple[Stats, Stats]:
    """Per channel, the median of the devices' means, and the median of their own variances (the within-device scale):
    one vote per device, so a device's claimed weight buys it nothing here."""
    w = torch.ones(len(stats), dtype=torch.float64)
    middle: Stats = {}
    spread: Stats = {}
    for name in stats[0]:
        means = weighted_median(torch.stack([s[name][0] for s in stats]), w)
        middle[name] = (means, means)
        spread[name] = (means, weighted_median(torch.stack([s[name][1] for s in stats]), w))
    return middle, spread


def _why(shift: float, spread: float, layer: str) -> str:
    return (
        f"its BN statistics are far from the other devices' (layer {layer}: channel means {shift:.2g} standard "
        f"deviations off, variances e^{spread:.2g} times off; bounds {SHIFT:g} and e^{SPREAD:.2g})"
    )


def _screen_pair(reports: Sequence[Report], weights: Sequence[float]) -> Combined:
    a, b = reports
    middle, spread = centre([a.stats, b.stats])
    shift, ratio, layer = max(
        (deviation(r.stats, middle, spread) for r in reports), key=lambda d: max(d[0] / SHIFT, d[1] / SPREAD)
    )
    # Against the midpoint, each sits half their distance away: the pair disagrees when that half exceeds the bounds.
    if shift > SHIFT / 2 or ratio > SPREAD / 2:
        reason = (
            f"it and the other device disagree (layer {layer}: channel means {2 * shift:.2g} standard deviations "
            f"apart, variances e^{2 * ratio:.2g} times apart; bounds {SHIFT:g} and e^{SPREAD:.2g}) and no third "
            "device can tell which is right"
        )
        refused = {r.device: reason for r in reports}
        first, second = sorted((a.device, b.device))  # by name, not by arrival: the line reads the same every run
        note = f"the two reports ({first}, {second}) disagree and no third device can tell which is right"
        return Combined(None, (), refused, note)
    return Combined(combine_statistics(list(zip(weights, (a.stats, b.stats)))), (a.device, b.device))


def robust_statistics(
    reports: Sequence[Report], rule: str = DEFAULT_BN_RULE, max_weight_ratio: float = 8.0
) -> Combined:
    """One variant's BN statistics from the devices' ``reports`` by ``rule`` (BN_RULES), weights capped by the ratio."""
    check_bn_rule(rule)
    if not reports:
        return Combined(None, (), note="no device reported")
    weights = capped(reports, max_weight_ratio)
    devices = tuple(r.device for r in reports)
    if rule == "mixture":
        return Combined(combine_statistics(list(zip(weights, (r.stats for r in reports)))), devices)
    if rule == "median":
        return Combined(median_statistics([r.stats for r in reports]), devices)
    if len(reports) == 1:
        return Combined(reports[0].stats, devices, note="one device: nothing to check its statistics against")
    if len(reports) == 2:
        return _screen_pair(reports, weights)
    middle, spread = centre([r.stats for r in reports])
    refused = {}
    for report in reports:
        shift, ratio, layer = deviation(report.stats, middle, spread)
        if shift > SHIFT or ratio > SPREAD:
            refused[report.device] = _why(shift, ratio, layer)
    kept = [(w, r) for w, r in zip(weights, reports) if r.device not in refused]
    if len(kept) * 2 <= len(reports):
        return Combined(None, (), refused, "half the devices or more were refused: no majority to trust")
    stats = combine_statistics([(w, r.stats) for w, r in kept])
    return Combined(stats, tuple(r.device for _, r in kept), refused)
