"""A preset for another input, designed from its device-budget range: family, cache targets, population (method §1-§4).

:func:`design_preset` answers "my images are 3x64x64, 5 classes, my devices
afford 2M to 200M MACs: which supernet family, which cache?" with the analytic
cost model and the cache search's own feasibility test, no forward pass:

1. **Strides** from the input size, so the last stage runs at about 4x4 (as the
   shipped presets do: 28 -> 4, 32 -> 4, 64 -> 4 with a stride-2 stem); one more
   stride-2 step is tried only when no family of the first reaches the low budget.
2. **Family**: one of the two shipped shapes (``fmnist-small``'s 3-block stages
   with large expansion ratios, or the paper's 9-block stages with its ratios),
   its channels scaled so that the full supernet has about ``HEADROOM`` x the
   top budget (fmnist-small: 99.7M = 2.5 x 40M), the width divisor 8, or 4 when
   8 cannot get below the low budget. Of the shapes that fit, the one needing
   the smaller rescaling wins.
3. **Cache targets** shaped like the shipped presets' (method §3): a main segment
   of ``MAIN_COUNT`` targets up to the top budget under ρ0 = 0.31 and a
   low-compute segment of ``LOW_COUNT`` targets down to the low budget under
   the smallest relaxed ρ0 (0.40 or above) at which every one of its targets
   is feasible for the GA's initial population (:func:`initial_draws`).
   **The top budget must be reachable**: the cache's own search job for the top
   target (:func:`top_search`) must find a network of at least ``REACH`` x the
   top budget. Above some size the fitness's 1000·ρ term loses more to a wider
   network than its entropy gains, so in a small family the search stops short
   (digits at 16x16, 0.5M..8M, divisor 4, scale 0.39: every target from 6.2M to
   8M finds the same 6.21M network); the family's scale is then raised a step at
   a time (at most ``MAX_REACH_STEPS``) until the top is reached.
4. **Population** budgets (method §4) from the range: Zipf over [low, 2.5 x high],
   allocation cap at the top budget (the paper's 1500M / 600M).
5. **Training recipe** (:func:`train_recipe`): ``fmnist-small``'s measured
   ``[train]`` table (no augmentation, lr 0.05) instead of method §7's heavy
   one, and batch 32 when the measured image folder holds fewer than
   ``SMALL_DATA_IMAGES`` images (bench/bench_label_skew.py, docs/presets.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from feast_edge.cache.fitness import OVER_RHO, effectiveness, population_evaluator
from feast_edge.cache.search import MAX_INITIAL_DRAWS, POPULATION, gene_box, search_target, split_genes
from feast_edge.cache.variants import DEFAULT_SEED
from feast_edge.data.task import Task
from feast_edge.errors import PresetError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.geometry import arch_layout, make_divisible
from feast_edge.space.preset import CacheSegment, Preset, RhoStep


@dataclass(frozen=True)
class Shape:
    """A shipped family's proportions: stem and stage channels at scale 1, depth and expansion choices."""

    preset: str
    stem: int
    stages: tuple[int, ...]
    max_extra_blocks: int
    expansion_ratios: tuple[float, ...]


SHAPES = (
    Shape("fmnist-small", 24, (24, 48, 96, 192), 2, (0.25, 0.5, 0.75, 1.0)),
    Shape("paper-cifar100", 64, (128, 256, 512, 1024), 8, (0.10, 0.14, 0.18, 0.22, 0.25)),
)
WIDTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SCALES = tuple(2 ** (k / 8) for k in range(-24, 41))  # 1/8 .. 32, 9 % apart
HEADROOM = 2.5  # full supernet MACs / top budget: fmnist-small 99.7M / 40M, the paper's budget_max / budget_cap
MIN_HEADROOM = 2.0
DIVISORS = (8, 4)
FINAL_RESOLUTION = 4
MAIN_RHO0 = 0.31  # the paper's main ceiling (method §3)
RELAXED_RHO0 = 0.40  # the paper's low-compute ceiling
RHO0_STEP = 0.05
MAX_RHO0 = 0.80
MAIN_COUNT = 20
LOW_COUNT = 6
MAX_LOW_COUNT = 12
SAMPLES = 1 << 17  # most uniform draws per target of the feasibility estimate
BATCH = 1 << 12
HITS = 256
REACH = 0.95  # the top target's search must find at least this fraction of the top budget (fmnist-small: 97.9 %)
MAX_REACH_STEPS = 8  # scale steps (9 % each) tried above the headroom rule's scale for a reachable top
DRAW_LIMIT = MAX_INITIAL_DRAWS // 4  # expected draws to fill the GA's first population must stay below this
# The [train] recipe of a designed preset (docs/presets.md §1.1, measured with bench/bench_label_skew.py): method §7's
# RandAugment + Mixup/CutMix at lr 0.025 regularises the paper's long runs on 50,000+ images, but on a few thousand
# images over tens of rounds the model hardly learns (digits, 20 rounds: 54 % test accuracy, 96 % with this one).
LIGHT_RECIPE = {"augment": "none", "lr": 0.05}  # fmnist-small's measured recipe (bench/bench_recipe.py)
SMALL_DATA_IMAGES = 10_000  # fewer measured images: batch 32, twice the local steps per round of batch 64
SMALL_DATA_BATCH = 32


@dataclass(frozen=True)
class PresetDesign:
    """A designed preset and what it was chosen from, for the file's comments and the console."""

    preset: Preset
    shape: Shape
    scale: float
    smallest_macs: int
    largest_macs: int
    largest_params: int
    smallest_rho: float
    low: float
    high: float
    draws: dict[str, float]  # segment name -> most expected initial draws over its targets
    top_macs: int = 0  # the network the cache's search job for the top target finds
    short_scale: float | None = None  # the headroom rule's scale, when its top search fell short of REACH
    short_macs: int = 0  # what that search found there
    stats_note: str = ""  # where mean/std came from
    extra_stride: bool = False  # one stride-2 step more than the ~4x4 rule, to get under the low budget
    images: int | None = None  # images counted in the --classes-from folder (None: not measured)

    @property
    def targets(self) -> tuple[float, ...]:
        return tuple(sorted(t for seg in self.preset.cache_segments for t in seg.targets))


def train_recipe(images: int | None) -> dict[str, object]:
    """The [train] table of a designed preset: :data:`LIGHT_RECIPE`, with batch 32 under ``SMALL_DATA_IMAGES`` images.

    ``images`` is the number of training images measured in the user's folder (None: not measured, batch 64 as
    method §7 and fmnist-small). With few images a device's shard is a handful of batches of 64, so a round is a
    handful of SGD steps; batch 32 doubles them at the same compute per round.
    """
    recipe = dict(LIGHT_RECIPE)
    if images is not None and images < SMALL_DATA_IMAGES:
        recipe["batch_size"] = SMALL_DATA_BATCH
    return recipe


def stride_plans(size: int) -> list[tuple[int, tuple[int, ...]]]:
    """``(stem stride, stage strides)`` plans for ``size``: last stage at about 4x4 first, then one more stride-2 step."""
    wanted = min(5, max(0, round(math.log2(max(size, 1) / FINAL_RESOLUTION))))  # 5: stem and every stage stride 2
    plans = []
    for steps in (wanted, wanted + 1):
        if steps > 5 or (plans and _final(size, plans[-1]) <= 2):
            break
        stages, stem = [1, 1, 1, 1], 1
        for slot in ("s4", "s3", "s2", "stem", "s1")[:steps]:  # the deepest stages downsample first, as in ResNet
            if slot == "stem":
                stem = 2
            else:
                stages[int(slot[1]) - 1] = 2
        plans.append((stem, tuple(stages)))
    return plans


def _final(size: int, plan: tuple[int, tuple[int, ...]]) -> int:
    resolution = math.ceil(size / plan[0])
    for s in plan[1]:
        resolution = math.ceil(resolution / s)
    return resolution


def _family(base: Preset, shape: Shape, scale: float, divisor: int, plan: tuple[int, tuple[int, ...]]) -> Preset:
    return replace(
        base,
        stem_channels=make_divisible(shape.stem * scale, 8),
        stem_stride=plan[0],
        stage_channels=tuple(make_divisible(c * scale, 8) for c in shape.stages),
        stage_strides=plan[1],
        max_extra_blocks=shape.max_extra_blocks,
        expansion_ratios=shape.expansion_ratios,
        width_multipliers=WIDTHS,
        divisor=divisor,
    )


def initial_draws(preset: Preset, target: float, rho0: float, population: int = POPULATION) -> float:
    """Expected uniform draws the GA needs to fill its first population at ``target`` / ``rho0`` (inf: none feasible).

    Estimated on draws from the same gene box the search draws from
    (``feast_edge.cache.search.initial_population``), with a fixed seed: batches
    of ``BATCH`` until ``HITS`` feasible ones (a share known to about 6 %) or
    ``SAMPLES`` draws.
    """
    evaluator = population_evaluator(preset)
    box = gene_box(evaluator, target)
    if (box == 0).any():
        return math.inf
    rng, hits, drawn = np.random.default_rng(0), 0, 0
    while hits < HITS and drawn < SAMPLES:
        genes = rng.integers(0, box, size=(BATCH, box.size))
        fitness = evaluator.evaluate(*split_genes(preset, genes), max_macs=target, rho0=rho0).fitness
        hits, drawn = hits + int((fitness > OVER_RHO).sum()), drawn + BATCH
    return math.inf if hits == 0 else population * drawn / hits


def _worst_draws(preset: Preset, targets: tuple[float, ...], rho0: float) -> float:
    return max(initial_draws(preset, t, rho0) for t in targets)


def cache_segments(preset: Preset, low: float, high: float) -> tuple[tuple[CacheSegment, ...], dict[str, float]] | None:
    """Main and low-compute segments over [low, high] whose every target is feasible, or None (see the module docstring)."""
    if high < 4 * low:  # a narrow range: one segment, under the ceiling its bottom needs
        for rho0 in _ladder(MAIN_RHO0):
            seg = CacheSegment("main", low, high, 10, rho0)
            worst = _worst_draws(preset, seg.targets, rho0)
            if worst <= DRAW_LIMIT:
                return (seg,), {"main": worst}
        return None
    start = float(round(max(2 * low, min(math.sqrt(low * high), high / 8))))
    while True:  # raise the main segment's start until ρ0 = 0.31 admits its bottom
        main = CacheSegment("main", start, high, MAIN_COUNT, MAIN_RHO0)
        main_draws = initial_draws(preset, start, MAIN_RHO0)
        if main_draws <= DRAW_LIMIT:
            break
        start = float(round(start * 1.25))
        if start > high / 2:
            return None
    stop = float(round(min(1.2 * start, high)))
    # At least LOW_COUNT targets, more (up to MAX_LOW_COUNT) to keep them at most 0.75 x low apart: the weakest
    # devices are the most numerous under a Zipf population, and each one gets the largest target it affords.
    count = min(MAX_LOW_COUNT, max(LOW_COUNT, math.ceil((stop - low) / (0.75 * low)) + 1))
    for rho0 in _ladder(RELAXED_RHO0):
        seg = CacheSegment("low-compute", low, stop, count, rho0)
        worst = _worst_draws(preset, seg.targets, rho0)
        if worst <= DRAW_LIMIT:
            return (main, seg), {"main": _worst_draws(preset, main.targets, MAIN_RHO0), "low-compute": worst}
    return None


def _ladder(first: float) -> list[float]:
    steps = round((MAX_RHO0 - first) / RHO0_STEP)
    return [round(first + i * RHO0_STEP, 2) for i in range(steps + 1)] if first < MAX_RHO0 else [first]


def design_preset(
    name: str,
    channels: int,
    size: int,
    class_names: tuple[str, ...],
    low: float,
    high: float,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    resize: str = "stretch",
    description: str | None = None,
    stats_note: str = "",
    images: int | None = None,
) -> PresetDesign:
    """The preset of a ``channels`` x ``size`` x ``size`` task whose devices afford ``low`` to ``high`` MACs.

    ``images``: the number of training images measured in the user's folder, which sets the [train] recipe
    (:func:`train_recipe`; None: not measured)."""
    # What the TOML file holds: statistics to 4 decimals, MAC counts as integers.
    mean = (0.5,) * channels if mean is None else tuple(round(float(v), 4) for v in mean)
    std = (0.25,) * channels if std is None else tuple(round(float(v), 4) for v in std)
    low, high = float(round(low)), float(round(high))
    Task(channels, size, class_names, mean, std, resize)  # the task contract's checks first (TaskError, one line)
    if not (0 < low < high and math.isfinite(high)):
        raise PresetError(
            f"budget range {low / 1e6:g}M..{high / 1e6:g}M MACs is inverted or empty; give LOW..HIGH with LOW < HIGH, e.g. 2M..200M"
        )
    shape_text = f"{channels}x{size}x{size}"
    base = Preset(
        name=name,
        description=description
        or f"{shape_text}, {len(class_names)} classes, devices of {macs_text(low)} to {macs_text(high)} MACs",
        in_channels=channels,
        input_size=size,
        classes=len(class_names),
        mean=mean,
        std=std,
        stem_channels=8,
        stem_stride=1,
        stage_channels=(8,),
        stage_strides=(1,),
        max_extra_blocks=0,
        expansion_ratios=(1.0,),
        width_multipliers=(1.0,),
        class_names=tuple(class_names),
        resize=resize,
        budget_min=low,
        budget_max=float(round(HEADROOM * high)),
        budget_cap=high,
        train=train_recipe(images),
    )
    floor, ceiling = math.inf, 0
    for rank, plan in enumerate(stride_plans(size)):
        for divisor in DIVISORS:
            fits = []
            for shape in SHAPES:
                found = _scaled(base, shape, divisor, plan, high)
                if found is None:
                    continue
                family, scale, smallest, largest = found
                ceiling = max(ceiling, largest)
                floor = min(floor, smallest)
                if smallest <= low:
                    fits.append((abs(math.log(scale)), shape.preset, family, shape, scale))
            for _, _, family, shape, scale in sorted(fits, key=lambda f: f[:2]):
                design = _reachable(base, family, shape, scale, divisor, plan, low, high, stats_note)
                if design is not None:
                    return replace(design, extra_stride=rank > 0, images=images)
    if ceiling == 0:
        top = _top(base)
        raise PresetError(
            f"top budget {macs_text(high)} MACs is beyond any supernet feast-edge builds for {shape_text} "
            f"(at most about {macs_text(top / MIN_HEADROOM)}); lower the top of --budgets"
        )
    raise PresetError(
        f"low budget {macs_text(low)} MACs is below what a supernet for {shape_text} reaches with a feasible cache "
        f"(its smallest architecture needs {macs_text(floor)} or more, plus room for the GA); raise the low end of --budgets"
    )


def _scaled(
    base: Preset, shape: Shape, divisor: int, plan: tuple[int, tuple[int, ...]], high: float
) -> tuple[Preset, float, int, int] | None:
    """The scale of ``shape`` whose full supernet is closest to ``HEADROOM`` x ``high`` (at least ``MIN_HEADROOM`` x)."""
    best = None
    for scale in SCALES:
        family = _family(base, shape, scale, divisor, plan)
        largest = arch_cost(family, Arch.largest(family))[0]
        if largest < MIN_HEADROOM * high:
            continue
        miss = abs(math.log(largest / (HEADROOM * high)))
        if best is not None and miss >= best[0]:
            break
        best = (miss, family, scale, largest)
    if best is None:
        return None
    _, family, scale, largest = best
    return family, scale, arch_cost(family, Arch.smallest(family))[0], largest


def top_search(preset: Preset) -> int:
    """MACs of the network that the default cache build's job for the top target finds (its target, ρ0 and seed)."""
    from feast_edge.cache.build import cache_jobs, cache_targets

    job = cache_jobs(cache_targets(preset), DEFAULT_SEED)[-1]
    return search_target(preset, job.target, job.rho0, job.seed).fitness.macs


def _reachable(
    base: Preset,
    family: Preset,
    shape: Shape,
    scale: float,
    divisor: int,
    plan: tuple[int, tuple[int, ...]],
    low: float,
    high: float,
    stats_note: str,
) -> PresetDesign | None:
    """The design at ``scale``, or at the first of the next ``MAX_REACH_STEPS`` scales whose top search reaches
    ``REACH`` x ``high`` (None: no feasible cache at ``scale``; no larger scale reaches: the design at ``scale``)."""
    first = None
    for step, candidate in enumerate(SCALES[SCALES.index(scale) :][: MAX_REACH_STEPS + 1]):
        family = family if step == 0 else _family(base, shape, candidate, divisor, plan)
        if arch_cost(family, Arch.smallest(family))[0] > low:
            break
        planned = cache_segments(family, low, high)
        if planned is None:
            if first is None:
                return None
            continue
        design = _designed(family, *planned, shape, candidate, low, high, stats_note)
        if first is None:
            first = design
        if design.top_macs >= REACH * high:
            return design if design is first else replace(design, short_scale=first.scale, short_macs=first.top_macs)
    return first


def _top(base: Preset) -> int:
    plan = stride_plans(base.input_size)[0]
    return max(arch_cost(f, Arch.largest(f))[0] for f in (_family(base, s, SCALES[-1], 8, plan) for s in SHAPES))


def _designed(
    family: Preset,
    segments: tuple[CacheSegment, ...],
    draws: dict[str, float],
    shape: Shape,
    scale: float,
    low: float,
    high: float,
    stats_note: str,
) -> PresetDesign:
    steps = [RhoStep(0, segments[-1].rho0)]
    if len(segments) > 1:
        steps.append(RhoStep(segments[0].start, segments[0].rho0))
    preset = replace(family, cache_segments=segments, extraction_rho=tuple(steps))
    smallest, largest = Arch.smallest(preset), Arch.largest(preset)
    return PresetDesign(
        preset=preset,
        shape=shape,
        scale=scale,
        smallest_macs=arch_cost(preset, smallest)[0],
        largest_macs=arch_cost(preset, largest)[0],
        largest_params=arch_cost(preset, largest)[1],
        smallest_rho=effectiveness(arch_layout(preset, smallest)),
        low=low,
        high=high,
        draws=draws,
        top_macs=top_search(preset),
        stats_note=stats_note,
    )


def macs_text(macs: float) -> str:
    """A MAC count for people: ``2M``, ``0.117M``, ``1.5G``, ``1.37T`` (three significant digits)."""
    for scale, unit in ((1e12, "T"), (1e9, "G")):
        if macs >= scale:
            return f"{macs / scale:.3g}{unit}"
    return f"{macs / 1e6:.3g}M"
