"""Federated BN statistics (feast_edge.evaluate.bn_stats): the devices' moments combine into the union's, and what
a device uploads is checked before the server uses it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.bn_stats import (
    MIN_EXAMPLES,
    StatisticsError,
    apply_statistics,
    bn_layers,
    bn_statistics,
    combine_statistics,
    decode_statistics,
    encode_statistics,
    layer_channels,
    statistics_size,
)
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

PRESET = load_preset("fmnist-small")
CACHE = load_cache(PRESET)


@pytest.fixture(scope="module")
def variant():
    return extract(Supernet(PRESET, seed=0), CACHE.entries[1].arch)


def _images(n: int, seed: int, shift: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 200, (n, 1, 28, 28), generator=g) + shift).clamp(0, 255).to(torch.uint8)


def test_moments_of_parts_combine_into_the_moments_of_their_union() -> None:
    a, b = torch.randn(300, 4) * 2 + 1, torch.randn(100, 4) * 0.5 - 3  # two devices, very different data
    stats = [(len(x), {"bn": (x.double().mean(0), x.double().var(0, unbiased=False))}) for x in (a, b)]
    mean, var = combine_statistics(stats)["bn"]
    union = torch.cat([a, b]).double()
    assert torch.allclose(mean, union.mean(0)) and torch.allclose(var, union.var(0, unbiased=False))


def test_the_first_layers_federated_statistics_are_exactly_the_unions(variant) -> None:
    """The first BN layer's input does not depend on any batch statistics: there, federated equals pooled exactly."""
    a, b = _images(60, 1), _images(20, 2, shift=60)  # a brighter second device
    first = next(iter(bn_layers(variant)))
    parts = [(len(x), bn_statistics(variant, x, PRESET, batch_size=20)) for x in (a, b)]
    combined = combine_statistics(parts)[first]
    pooled = bn_statistics(variant, torch.cat([a, b]), PRESET, batch_size=20)[first]
    assert torch.allclose(combined[0], pooled[0]) and torch.allclose(combined[1], pooled[1])
    own = parts[1][1][first]  # the second device alone describes a different distribution
    assert (own[0] - pooled[0]).abs().max() > 10 * (combined[0] - pooled[0]).abs().max() + 1e-3


def test_statistics_are_recalibrations_moments_and_leave_the_model_as_it_was(variant) -> None:
    images = _images(50, 3)
    before = {k: v.clone() for k, v in variant.state_dict().items()}
    variant.eval()
    stats = bn_statistics(variant, images, PRESET, batch_size=50)
    assert not variant.training and all(torch.equal(before[k], v) for k, v in variant.state_dict().items())
    # One batch: the recalibrated running mean is exactly that batch's mean (the variance differs by n/(n-1)).
    recalibrate_bn(variant, pixel_batches(images, PRESET, 50))
    for name, module in bn_layers(variant).items():
        assert torch.allclose(module.running_mean.double(), stats[name][0], atol=1e-5)
    apply_statistics(variant, stats)
    for name, module in bn_layers(variant).items():
        assert torch.allclose(module.running_var.double(), stats[name][1], atol=1e-6)
    variant.load_state_dict(before)


def test_statistics_round_trip_through_their_encoding(variant) -> None:
    stats = bn_statistics(variant, _images(20, 4), PRESET)
    blob = encode_statistics([stats, stats], 20)
    layers = layer_channels(variant)
    assert len(blob) <= statistics_size([layers, layers])
    examples, decoded = decode_statistics(blob, [layers, layers], max_examples=100)
    assert examples == 20 and len(decoded) == 2
    assert all(torch.equal(decoded[1][n][0], stats[n][0]) for n in layers)


def _blob(tensors: dict[str, torch.Tensor], examples: str = "20", fmt: str = "feast-edge/bn-statistics") -> bytes:
    return save(tensors, metadata={"format": fmt, "examples": examples})


def test_malformed_statistics_are_refused_with_the_reason(variant) -> None:
    layers = layer_channels(variant)
    good = {
        f"0/{n}.{part}": (torch.ones(c) if part == "var" else torch.zeros(c)).double()
        for n, c in layers.items()
        for part in ("mean", "var")
    }
    name = next(iter(layers))
    header = json.dumps({"__metadata__": {"format": 5}, "a": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})
    cases = {
        "not a valid safetensors": b"\x00" * 4,
        "header size": (10**9).to_bytes(8, "little") + b"{}",
        "not a valid safetensors file": (100_000).to_bytes(8, "little") + b"[" * 100_000,  # deep JSON
        "format": _blob(good, fmt="feast-edge/variant-weights"),
        "examples; it must be": _blob(good, examples=str(MIN_EXAMPLES - 1)),
        "it reports '101' examples": _blob(good, examples="101"),
        "it reports '1e3'": _blob(good, examples="1e3"),
        "names differ": _blob({k: v for k, v in good.items() if not k.startswith(f"0/{name}.")}),
        "names differ ": _blob({**good, "1/extra.mean": torch.zeros(1).double()}),
        "not float64": _blob({**good, f"0/{name}.mean": torch.zeros(layers[name])}),
        "not float64 ": _blob({**good, f"0/{name}.mean": torch.zeros(layers[name] + 1).double()}),
        "non-finite": _blob({**good, f"0/{name}.mean": torch.full((layers[name],), float("nan")).double()}),
        "negative variances": _blob({**good, f"0/{name}.var": -torch.ones(layers[name]).double()}),
        "metadata": len(header).to_bytes(8, "little") + header.encode() + b"\x00" * 8,
    }
    for reason, blob in cases.items():
        with pytest.raises(StatisticsError, match=reason.strip().split(";")[0].replace("(", r"\(")):
            decode_statistics(blob, [layers], max_examples=100)


def test_statistics_for_another_model_are_not_applied(variant) -> None:
    with pytest.raises(StatisticsError, match="BN layers"):
        apply_statistics(variant, {"stem.bn": (torch.zeros(1), torch.ones(1))})
