"""Training-free fitness of an architecture at a MAC target (method §3, paper Eq. 10).

The fitness is DeepFedNAS' objective, reused unchanged:

    fitness = entropy − β·exp(Var(1 + d_j)) + 1000·ρ − Σ_j max(0, C_j − C_{j+1})

with infeasible architectures mapped to sentinels (−1e9 over the MAC target,
−1e8 over the effectiveness ceiling ρ0). Two evaluators share one definition:

* :func:`evaluate` — one architecture, read from its :class:`~feast_edge.space.geometry.Layout`;
* :class:`PopulationEvaluator` — a whole GA population as integer gene arrays,
  vectorized with numpy. Its channel tables are read from ``arch_layout`` too,
  so the channel arithmetic stays in ``geometry``; tests check that both agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from feast_edge.space.arch import Arch
from feast_edge.space.cost import count_macs
from feast_edge.space.geometry import Layout, StageLayout, arch_layout
from feast_edge.space.preset import Preset

BETA = 10.0  # weight of the depth-variance penalty (method §3)
RHO_WEIGHT = 1000.0  # weight of the effectiveness term (method §3)
OVER_BUDGET = -1e9  # fitness of an architecture with MAC(a) > B
OVER_RHO = -1e8  # fitness of an architecture with ρ(a) > ρ0


@dataclass(frozen=True)
class Fitness:
    """Fitness terms of one architecture at one target (method §3)."""

    fitness: float
    rho: float
    entropy: float
    macs: int

    @property
    def feasible(self) -> bool:
        return self.fitness > OVER_RHO


# ------------------------------------------------------------------ scalar terms
def _stage_log_widths(stage: StageLayout) -> list[float]:
    """Log widths (``c_in·k²``) of a stage's convs: conv1/conv2 per block, then the projection."""
    logs = []
    c_in = stage.in_channels
    for _ in range(stage.blocks):
        logs += [math.log(c_in * 9), math.log(stage.mid * 9)]
        c_in = stage.channels
    logs.append(math.log(stage.in_channels))  # block-0 1×1 projection
    return logs


def entropy(layout: Layout) -> float:
    """``Σ_j log(H_j²·C_j)·S_j`` over stages, α_j = 1 (method §3)."""
    return sum(math.log(s.resolution**2 * s.channels) * sum(_stage_log_widths(s)) for s in layout.stages)


def effectiveness(layout: Layout) -> float:
    """ρ = L / exp(mean log width) over every conv layer, stem included (method §3)."""
    logs = [math.log(layout.in_channels * 9)]
    for stage in layout.stages:
        logs += _stage_log_widths(stage)
    return len(logs) / math.exp(sum(logs) / len(logs))


def depth_penalty(layout: Layout, beta: float = BETA) -> float:
    """``β·exp(Var(1 + d_j))``, population variance of the stage block counts (method §3)."""
    blocks = [s.blocks for s in layout.stages]
    mean = sum(blocks) / len(blocks)
    return beta * math.exp(sum((b - mean) ** 2 for b in blocks) / len(blocks))


def width_penalty(layout: Layout) -> float:
    """``Σ_j max(0, C_j − C_{j+1})``: how much the stage widths decrease (method §3)."""
    widths = [s.channels for s in layout.stages]
    return float(sum(max(0, a - b) for a, b in zip(widths, widths[1:])))


def score(layout: Layout, beta: float = BETA) -> float:
    """Unconstrained fitness of a layout (method §3)."""
    return entropy(layout) - depth_penalty(layout, beta) + RHO_WEIGHT * effectiveness(layout) - width_penalty(layout)


def constrained(value: float, macs: int, rho: float, max_macs: float, rho0: float) -> float:
    """Apply the infeasibility sentinels: MAC over target first, then ρ over ceiling (method §3)."""
    if macs > max_macs:
        return OVER_BUDGET
    if rho > rho0:
        return OVER_RHO
    return value


def evaluate(
    preset: Preset,
    arch: Arch,
    max_macs: float = math.inf,
    rho0: float = math.inf,
    classes: int | None = None,
) -> Fitness:
    """Fitness of ``arch`` under target ``max_macs`` and ceiling ``rho0`` (method §3).

    ``classes`` sets the head used for the MAC count (default: the preset's);
    the fitness terms themselves do not depend on it.
    """
    layout = arch_layout(preset, arch, classes)
    macs = count_macs(layout)
    rho = effectiveness(layout)
    return Fitness(constrained(score(layout), macs, rho, max_macs, rho0), rho, entropy(layout), macs)


# ------------------------------------------------------------ vectorized terms
@dataclass(frozen=True)
class PopulationFitness:
    """Fitness terms of a population, one array entry per individual."""

    fitness: np.ndarray  # float64 (P,)
    rho: np.ndarray  # float64 (P,)
    entropy: np.ndarray  # float64 (P,)
    macs: np.ndarray  # int64 (P,)

    @property
    def feasible(self) -> np.ndarray:
        return self.fitness > OVER_RHO


class PopulationEvaluator:
    """Vectorized method §3 fitness over integer gene arrays of one preset.

    Genes per individual: ``d`` (extra blocks, ``(P, S)``), ``e`` (expansion
    *indices*, ``(P, S)``), ``w`` (width indices, ``(P, S + 1)``, stem first).
    """

    def __init__(self, preset: Preset, classes: int | None = None) -> None:
        self.preset = preset
        self.classes = preset.classes if classes is None else classes
        n, n_w, n_e = preset.num_stages, len(preset.width_multipliers), len(preset.expansion_ratios)
        stem = np.zeros(n_w, dtype=np.int64)
        chans = np.zeros((n, n_w), dtype=np.int64)
        mids = np.zeros((n, n_w, n_e), dtype=np.int64)
        # Every channel count comes from geometry.arch_layout of a uniform arch.
        for wi in range(n_w):
            for ei, ratio in enumerate(preset.expansion_ratios):
                layout = arch_layout(preset, Arch(d=(0,) * n, e=(ratio,) * n, w=(wi,) * (n + 1)), self.classes)
                stem[wi] = layout.stem_channels
                chans[:, wi] = [s.channels for s in layout.stages]
                mids[:, wi, ei] = [s.mid for s in layout.stages]
        self.stem, self.chans, self.mids = stem, chans, mids
        self.in_channels = layout.in_channels
        self.stem_area = layout.stem_resolution**2
        self.areas = np.array([s.resolution**2 for s in layout.stages], dtype=np.int64)
        self.log_hw = np.log(self.areas.astype(np.float64))
        self.stage_index = np.arange(n)

    def evaluate(
        self,
        d: np.ndarray,
        e: np.ndarray,
        w: np.ndarray,
        max_macs: float = math.inf,
        rho0: float = math.inf,
        beta: float = BETA,
    ) -> PopulationFitness:
        """Fitness of every individual; agrees with :func:`evaluate` to float precision."""
        d, e, w = (np.asarray(a, dtype=np.int64) for a in (d, e, w))
        stages = self.stage_index
        c_stem = self.stem[w[:, 0]]  # (P,)
        c_out = self.chans[stages, w[:, 1:]]  # (P, S)
        mid = self.mids[stages, w[:, 1:], e]  # (P, S)
        c_in = np.concatenate([c_stem[:, None], c_out[:, :-1]], axis=1)  # stage input widths
        blocks = 1 + d
        extra = d  # blocks after block 0: input width is the stage width

        macs = self.in_channels * c_stem * 9 * self.stem_area
        per_stage = self.areas * (9 * mid * (c_in + c_out) + extra * 9 * mid * 2 * c_out + c_in * c_out)
        macs = macs + per_stage.sum(axis=1) + c_out[:, -1] * self.classes

        log_in, log_mid9, log_out9 = np.log(c_in * 9.0), np.log(mid * 9.0), np.log(c_out * 9.0)
        stage_logs = log_in + log_mid9 + extra * (log_out9 + log_mid9) + np.log(c_in.astype(np.float64))
        ent = ((self.log_hw + np.log(c_out.astype(np.float64))) * stage_logs).sum(axis=1)

        layers = 1 + (2 * blocks + 1).sum(axis=1)
        mean_log = (math.log(self.in_channels * 9) + stage_logs.sum(axis=1)) / layers
        rho = layers / np.exp(mean_log)

        var = blocks.var(axis=1)
        decrease = np.maximum(0, c_out[:, :-1] - c_out[:, 1:]).sum(axis=1)
        value = ent - beta * np.exp(var) + RHO_WEIGHT * rho - decrease
        value = np.where(rho > rho0, OVER_RHO, value)
        value = np.where(macs > max_macs, OVER_BUDGET, value)
        return PopulationFitness(value, rho, ent, macs)


@lru_cache(maxsize=64)
def population_evaluator(preset: Preset, classes: int | None = None) -> PopulationEvaluator:
    """Shared :class:`PopulationEvaluator` per (preset, classes)."""
    return PopulationEvaluator(preset, classes)
