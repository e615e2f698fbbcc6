"""The budget a device profile implies: the latency fit, the training-memory estimate and the largest affordable MACs.

Two limits decide which cached variants a device may be served and trained on (``feast_edge.budget.profile``):

* **latency**: ``a + b·MACs ≤ latency_target_ms`` at batch 1, with ``a`` (ms) and ``b`` (ms per million MACs)
  fitted by least squares to timed cached variants (:func:`fit_latency`);
* **memory**: local co-training (method §7) of the envelope routed at the budget (method §5) must fit in the memory
  limit (:func:`training_memory_bytes` gives the estimate and its formula).

:func:`derive_budget` is the largest cached variant's MACs meeting both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from feast_edge.cache.variants import VariantCache
from feast_edge.errors import FeastError, ProfileError
from feast_edge.route.envelope import Envelope
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset

TRAIN_BATCH_SIZE = 64  # method §4: local batch size of co-training
FLOAT_BYTES = 4


def fit_latency(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a ms, b ms/MMAC)`` of ``ms ≈ a + b·MACs/1e6`` over ``(MACs, ms)`` points, with ``a >= 0``.

    The unconstrained fit is returned when its intercept is non-negative. A
    negative intercept (noise on a device with little fixed overhead) is
    physically meaningless; the least-squares optimum under ``a >= 0`` then
    lies on ``a = 0``, i.e. the fit through the origin ``b = Σxy / Σx²``.
    """
    xs = [float(m) / 1e6 for m, _ in points]
    ys = [float(ms) for _, ms in points]
    if len(set(xs)) < 2:
        raise ProfileError(
            f"fitting latency ≈ a + b·MACs needs at least 2 variants with different MACs (got {len(set(xs))}); raise --variants"
        )
    if not all(math.isfinite(v) and v > 0 for v in xs + ys):
        raise ProfileError("latency measurements must be positive finite (MACs, ms) pairs; time the variants again")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if b <= 0:
        raise ProfileError(
            f"the measured latency does not grow with MACs (slope {b:.4g} ms/MMAC); the timings are dominated by noise: "
            "close other programs, raise --repeats or --variants, or profile on a quieter machine"
        )
    return a, b


def activation_elements(preset: Preset, arch: Arch, classes: int | None = None) -> int:
    """Per-example output elements of every conv (stem, conv1, conv2, projections) and the classifier of ``arch``."""
    layout = arch_layout(preset, arch, classes)
    total = layout.stem_channels * layout.stem_resolution**2
    for stage in layout.stages:
        area = stage.resolution**2
        total += stage.channels * area  # block-0 projection
        total += stage.blocks * (stage.mid + stage.channels) * area  # conv1, conv2 of every block
    return total + layout.classes


def training_memory_bytes(
    preset: Preset,
    envelope_params: int,
    batch_size: int,
    archs: Sequence[Arch],
    classes: int | None = None,
) -> int:
    """Estimated peak memory of one client's local co-training (method §7) in float32 bytes.

    ``3 · 4 · envelope_params`` (weights, gradients, SGD momentum of the routed
    envelope) ``+ 2 · 4 · batch_size · max_a activation_elements(a)``: the
    activations kept for backward of the largest affordable variant (variants
    are trained one after another, each backward frees its graph, so the peak
    is the largest one), counted as conv outputs × 2 for the BN outputs that
    backward also keeps. An estimate: it leaves out the CUDA context,
    cuDNN workspaces and allocator slack, which is why profiles grant only a
    fraction of the device's memory (``memory_fraction``).
    """
    if not archs:
        raise ProfileError(
            "training memory of an empty affordable set is undefined; the device can afford no cached variant"
        )
    if batch_size < 1 or envelope_params < 1:
        raise ProfileError(
            f"training memory needs batch_size >= 1 and envelope_params >= 1 (got {batch_size}, {envelope_params})"
        )
    activations = max(activation_elements(preset, arch, classes) for arch in archs)
    return 3 * FLOAT_BYTES * envelope_params + 2 * FLOAT_BYTES * batch_size * activations


def _envelope_memory(cache: VariantCache, preset: Preset, budget: float, batch_size: int) -> int:
    archs = [e.arch for e in cache.affordable(budget)]
    params = Envelope.of(archs).params(preset, cache.classes)
    return training_memory_bytes(preset, params, batch_size, archs, cache.classes)


EVALUATION_BATCH = 500  # the batch feast_edge.evaluate.evaluation.accuracy tests held-out examples in


def evaluation_memory_bytes(
    cache: VariantCache, preset: Preset, budget: float, batch_size: int = EVALUATION_BATCH
) -> int:
    """Estimated peak memory of evaluating (and BN-calibrating) the variants of the envelope routed at ``budget``.

    ``2 · 4 · envelope_params`` (the routed payload and the model built from it) ``+ 2 · 4 · batch_size ·
    max_a activation_elements(a)`` (no gradients: a forward keeps at most a layer's input and output). Far below
    training's (:func:`training_memory_bytes`), which is why a device may evaluate variants it cannot train or serve.
    """
    archs = [e.arch for e in cache.affordable(budget)]
    if not archs:
        return 0
    params = Envelope.of(archs).params(preset, cache.classes)
    activations = max(activation_elements(preset, arch, cache.classes) for arch in archs)
    return 2 * FLOAT_BYTES * params + 2 * FLOAT_BYTES * batch_size * activations


def evaluation_limit(cache: VariantCache, preset: Preset, memory_limit_bytes: int) -> int:
    """The largest cached MACs whose routed envelope evaluates within ``memory_limit_bytes`` (0 if even the smallest
    does not)."""
    fits = [e.macs for e in cache.entries if evaluation_memory_bytes(cache, preset, e.macs) <= memory_limit_bytes]
    return max(fits, default=0)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def derive_budget(
    cache: VariantCache,
    preset: Preset,
    a: float,
    b: float,
    latency_target_ms: float,
    memory_limit_bytes: int,
    batch_size: int = TRAIN_BATCH_SIZE,
) -> float:
    """The largest cached MACs whose variant meets the latency target and whose routed envelope trains within the memory limit.

    Both limits grow monotonically with the budget (latency with MACs; the
    routed envelope and the largest activations with the nested affordable
    set, method §5), so the affordable budgets form a prefix of the cache.
    """
    if cache.preset_name != preset.name:
        raise ProfileError(
            f"the variant cache belongs to preset {cache.preset_name}, not {preset.name}; load the cache of preset {preset.name}"
        )
    if not (b > 0 and a >= 0 and latency_target_ms > 0 and memory_limit_bytes > 0 and batch_size >= 1):
        raise ProfileError(
            f"deriving a budget needs a >= 0, b > 0, a positive latency target, memory limit and batch size "
            f"(got a={a}, b={b}, target={latency_target_ms}, memory={memory_limit_bytes}, batch={batch_size})"
        )
    budget = None
    for entry in cache.entries:
        fast = a + b * entry.macs / 1e6 <= latency_target_ms
        if not (fast and _envelope_memory(cache, preset, entry.macs, batch_size) <= memory_limit_bytes):
            break
        budget = float(entry.macs)
    if budget is not None:
        return budget
    smallest = cache.smallest
    latency = a + b * smallest.macs / 1e6
    memory = _envelope_memory(cache, preset, smallest.macs, batch_size)
    problems = []
    if latency > latency_target_ms:
        problems.append(
            f"its estimated latency {latency:.3f} ms (a + b·MACs) exceeds the latency target {latency_target_ms:g} ms; "
            f"raise --latency-target-ms to at least {math.ceil(latency * 1000) / 1000:g}"
        )
    if memory > memory_limit_bytes:
        problems.append(
            f"training its routed envelope at batch {batch_size} needs about {_mib(memory)} but the memory limit is "
            f"{_mib(memory_limit_bytes)}; raise --memory-fraction or free memory on the device"
        )
    raise ProfileError(
        f"even the smallest cached variant of preset {preset.name} ({smallest.macs / 1e6:.2f}M MACs) misses this device's limits: "
        + "; ".join(problems)
        + " (or use a preset with smaller variants)"
    )


def parse_macs(text: str) -> float:
    """MAC counts as ``25000000``, ``25e6``, ``25M``, ``1.5G`` or ``800K``."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(raw[-1:].upper(), 1.0)
    number = raw[:-1] if scale != 1.0 else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise FeastError(f"cannot read {text!r} as a MAC count; write e.g. 25000000, 25e6 or 25M") from None
    if not value > 0 or value != value or value == float("inf"):
        raise FeastError(f"MAC count {text!r} must be a positive finite number")
    return value
