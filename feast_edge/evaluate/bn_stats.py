"""Federated BN statistics: a served variant's BN recalibrated on the federation's data without moving it (method §8).

    device:  bn_statistics(variant, a seeded sample of its training split) -> per BN layer, per channel,
             the mean and variance of the layer's input (float64), from the same train-mode pass as
             ``recalibrate_bn``; encode_statistics(...) -> a safetensors blob, uploaded like an update
    server:  decode_statistics(blob, expected layers) -> checked (names, shapes, dtype, finite, var >= 0)
             combine_statistics([(weight_i, stats_i)]) -> the weighted mixture (law of total variance):
                 mean = Σ w_i μ_i / W,   var = Σ w_i (σ_i² + μ_i²) / W - mean²
             with w_i the device's training examples: the statistics of the union of the devices' data
             apply_statistics(variant, combined) -> its running_mean / running_var

Why: a device's data is skewed (non-IID). Its own recalibration describes its own class mix; a device
holding three classes serves a model tuned to them (on the demo, the smallest device's test accuracy
fell to 64 % where the union's statistics give 78 %, docs/benchmarks.md). Only per-channel moments
leave a device, the same kind of numbers every update already carries in its BN buffers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from feast_edge.errors import FeastError
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.space.preset import Preset

STATISTICS_FORMAT = "feast-edge/bn-statistics"
MIN_EXAMPLES = 8  # a device reports statistics of at least this many examples (fewer would describe single images)

Stats = dict[str, tuple[torch.Tensor, torch.Tensor]]  # BN module name -> (mean, var), float64 [C]


class StatisticsError(FeastError):
    """A device's BN statistics are malformed or do not match the variants asked for."""


def bn_layers(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """The model's BN modules by name, in forward order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def layer_channels(model: nn.Module) -> dict[str, int]:
    """Each BN module's channel count: what a device's statistics for ``model`` must hold."""
    return {n: int(m.num_features) for n, m in bn_layers(model).items()}


@torch.no_grad()
def bn_statistics(
    model: nn.Module, images: torch.Tensor, preset: Preset, batch_size: int = 100, device: str | torch.device = "cpu"
) -> Stats:
    """Per BN layer, the per-channel mean and (population) variance of its input over ``images`` (uint8).

    The forward runs in train mode, as BN recalibration does: each layer normalizes with its batch's statistics, so a
    layer's input does not depend on the running statistics being estimated. The model's own BN buffers are restored.
    """
    layers = bn_layers(model)
    saved = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in layers.items()}
    sums: dict[str, list] = {n: [0, 0, 0] for n in layers}  # Σx, Σx², count per channel

    def hook(name: str):
        def pre(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach().double()
            dims = [0, *range(2, x.dim())]
            acc = sums[name]
            acc[0] = acc[0] + x.sum(dims)
            acc[1] = acc[1] + (x * x).sum(dims)
            acc[2] += x.numel() // x.shape[1]

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    was_training = model.training
    model.to(device).train()
    try:
        for x in pixel_batches(images, preset, batch_size, device):
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        for n, m in layers.items():
            m.load_state_dict(saved[n])
    out: Stats = {}
    for name, (s, q, count) in sums.items():
        if not count:
            raise ValueError("BN statistics need at least one image")
        mean = (s / count).cpu()
        out[name] = (mean, (q / count).cpu() - mean * mean)
    return out


def encode_statistics(variants: Sequence[Stats], examples: int) -> bytes:
    """The statistics of each requested variant (in the request's order) as one safetensors blob."""
    from safetensors.torch import save

    tensors = {}
    for k, stats in enumerate(variants):
        for name, (mean, var) in stats.items():
            tensors[f"{k}/{name}.mean"] = mean.double().clone().contiguous()
            tensors[f"{k}/{name}.var"] = var.double().clamp_min(0).contiguous()
    return save(tensors, metadata={"format": STATISTICS_FORMAT, "examples": str(int(examples))})


def statistics_size(expected: Sequence[Mapping[str, int]]) -> int:
    """An upper bound of the encoded size of statistics for these variants (to bound the upload before it arrives)."""
    entries = sum(len(layers) for layers in expected)
    values = sum(sum(layers.values()) for layers in expected)
    return 16 * values + 160 * 2 * entries + 4096


def decode_statistics(blob: bytes, expected: Sequence[Mapping[str, int]], max_examples: int) -> tuple[int, list[Stats]]:
    """(examples, per variant its statistics) from a device's ``blob``, if it holds exactly the ``expected`` layers
    (per variant: BN name -> channels) as finite float64 means and non-negative variances; StatisticsError if not."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        meta = _metadata(blob)
        tensors = load(blob)
    except (SafetensorError, ValueError, RuntimeError, RecursionError) as exc:
        raise StatisticsError(f"not a valid safetensors file ({str(exc)[:200]})") from None
    if meta.get("format") != STATISTICS_FORMAT:
        raise StatisticsError(f"its format is {str(meta.get('format'))[:40]!r}, not {STATISTICS_FORMAT!r}")
    text = meta.get("examples", "")
    if not (text.isascii() and text.isdigit() and len(text) <= 15 and MIN_EXAMPLES <= int(text) <= max_examples):
        raise StatisticsError(
            f"it reports {text[:20]!r} examples; it must be between {MIN_EXAMPLES} and {max_examples}"
        )
    want = {
        f"{k}/{n}.{part}": c for k, layers in enumerate(expected) for n, c in layers.items() for part in ("mean", "var")
    }
    if set(tensors) != set(want):
        raise StatisticsError("its tensors are not the BN layers of the variants asked for (names differ)")
    for key, tensor in tensors.items():
        if tensor.dtype != torch.float64 or tuple(tensor.shape) != (want[key],):
            raise StatisticsError(f"{key} is {tensor.dtype} {tuple(tensor.shape)}, not float64 ({want[key]},)")
        if not bool(torch.isfinite(tensor).all()) or (key.endswith(".var") and bool((tensor < 0).any())):
            raise StatisticsError(f"{key} holds non-finite values or negative variances")
    variants = [
        {n: (tensors[f"{k}/{n}.mean"], tensors[f"{k}/{n}.var"]) for n in layers} for k, layers in enumerate(expected)
    ]
    return int(text), variants


def _metadata(blob: bytes) -> dict[str, str]:
    """The string metadata in a safetensors blob's JSON header (read before any tensor is)."""
    if len(blob) < 8:
        raise ValueError("too short for a safetensors header")
    size = int.from_bytes(blob[:8], "little")
    if not 0 < size <= min(len(blob) - 8, 1 << 20):
        raise ValueError("its header size is out of range")
    header = json.loads(blob[8 : 8 + size])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("its metadata is not a map of strings")
    return meta


def combine_statistics(reports: Sequence[tuple[float, Stats]]) -> Stats:
    """The weighted mixture of the devices' statistics (law of total variance); weights are training examples."""
    total = math.fsum(w for w, _ in reports)
    if not reports or total <= 0:
        raise ValueError("combining BN statistics needs at least one report with a positive weight")
    combined: Stats = {}
    for name in reports[0][1]:
        mean = sum(w * s[name][0] for w, s in reports) / total
        second = sum(w * (s[name][1] + s[name][0] ** 2) for w, s in reports) / total
        combined[name] = (mean, (second - mean * mean).clamp_min(0))
    return combined


@torch.no_grad()
def apply_statistics(model: nn.Module, stats: Stats) -> None:
    """Set each BN layer's running statistics to ``stats`` (the model then serves in eval mode with them)."""
    layers = bn_layers(model)
    if set(layers) != set(stats):
        raise StatisticsError("the statistics do not name the model's BN layers")
    for name, module in layers.items():
        mean, var = stats[name]
        module.running_mean.copy_(mean.to(module.running_mean.dtype))
        module.running_var.copy_(var.to(module.running_var.dtype))
        if module.num_batches_tracked is not None:
            module.num_batches_tracked.fill_(1)
    model.eval()
