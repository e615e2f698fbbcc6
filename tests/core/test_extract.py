"""Extraction: a plain static model whose eval outputs equal the supernet's active forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from feast_edge.space.arch import Arch
from feast_edge.space.elastic import ElasticBatchNorm2d, ElasticConv2d, ElasticLinear
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET, archs

SMALL = load_preset("fmnist-small")
TINY = load_preset(str(TINY_PRESET))


def _trained_like(preset, seed=0):
    """A supernet with non-trivial BN statistics (a few train-mode passes under random archs)."""
    model = Supernet(preset, seed=seed).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for arch in (Arch.largest(preset), Arch.smallest(preset)):
            model(torch.randn(16, preset.in_channels, preset.input_size, preset.input_size, generator=g) * 2 + 1, arch)
    return model.eval()


@pytest.mark.parametrize("preset", [TINY, SMALL], ids=lambda p: p.name)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_extracted_equals_active_supernet(preset, data):
    arch = data.draw(archs(preset))
    supernet = _trained_like(preset)
    static = extract(supernet, arch)
    x = torch.randn(
        4, preset.in_channels, preset.input_size, preset.input_size, generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        diff = (supernet(x, arch) - static(x)).abs().max().item()
    assert diff <= 1e-5


def test_extracted_model_is_plain_pytorch():
    static = extract(_trained_like(TINY), Arch((1, 0, 2), (0.5, 1.0, 0.5), (2, 1, 3, 0)))
    kinds = {type(m) for m in static.modules()}
    assert not kinds & {ElasticConv2d, ElasticBatchNorm2d, ElasticLinear}
    assert {nn.Conv2d, nn.BatchNorm2d, nn.Linear} <= kinds


def test_extraction_copies_weights():
    supernet = _trained_like(TINY)
    arch = Arch((0, 0, 0), (0.5,) * 3, (0,) * 4)
    static = extract(supernet, arch)
    with torch.no_grad():
        static.stem.conv.weight.add_(1.0)
    assert not torch.equal(supernet.stem.conv.weight[: static.stem.conv.weight.shape[0]], static.stem.conv.weight)


def test_paper_preset_extraction_matches():
    preset = load_preset("paper-cifar100")
    supernet = Supernet(preset, seed=0).eval()
    arch = Arch((3, 7, 6, 7), (0.18, 0.18, 0.1, 0.1), (2, 0, 0, 0, 0))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (supernet(x, arch) - extract(supernet, arch)(x)).abs().max().item() <= 1e-5
