"""Elastic supernet: forward under any arch, gradients reach exactly the active slice, BN recalibration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.errors import ArchError
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract_calibrated
from feast_edge.space.geometry import arch_layout, envelope_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET, archs

SMALL = load_preset("fmnist-small")
TINY = load_preset(str(TINY_PRESET))


def _batch(preset, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, preset.in_channels, preset.input_size, preset.input_size, generator=g)


@pytest.mark.parametrize("name", ["paper-cifar100", "paper-cinic10", "paper-tinyimagenet", "fmnist-small"])
def test_forward_shapes_every_preset(name):
    preset = load_preset(name)
    model = Supernet(preset).eval()
    for arch in (Arch.smallest(preset), Arch((0,) * 4, (preset.expansion_ratios[1],) * 4, (1, 2, 0, 1, 2))):
        with torch.no_grad():
            out = model(_batch(preset, 2), arch)
        assert out.shape == (2, preset.classes)
        assert torch.isfinite(out).all()


def _active_shapes(preset, arch):
    return {k: v.shape for k, v in StaticResNet(arch_layout(preset, arch)).state_dict().items()}


@pytest.mark.parametrize("preset", [TINY, SMALL], ids=lambda p: p.name)
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_gradients_reach_exactly_the_active_slice(preset, data):
    arch = data.draw(archs(preset))
    model = Supernet(preset, seed=1).train()
    active = _active_shapes(preset, arch)
    touched = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for seed in range(3):
        model.zero_grad(set_to_none=True)
        head = torch.randn(preset.classes, generator=torch.Generator().manual_seed(seed))
        (model(_batch(preset, 8, seed), arch) * head).sum().backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                touched[name] += p.grad.abs()
    for name, grad in touched.items():
        mask = torch.zeros_like(grad, dtype=torch.bool)
        if name in active:
            mask[tuple(slice(0, n) for n in active[name])] = True
        assert grad[~mask].abs().max().item() == 0 if (~mask).any() else True, (
            f"{name}: inactive positions got gradient"
        )
        if name in active:
            assert (grad[mask] != 0).all(), f"{name}: an active position never received gradient"


def test_bn_running_stats_update_only_the_active_slice():
    model = Supernet(TINY, seed=0).train()
    arch = Arch((1, 0, 0), (0.5, 0.5, 0.5), (1, 1, 1, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model(_batch(TINY, 8) * 3 + 1, arch)
    active = _active_shapes(TINY, arch)
    for name, tensor in model.state_dict().items():
        if "running_" not in name:
            continue
        changed = tensor != before[name]
        if name in active:
            inside = tuple(slice(0, n) for n in active[name])
            assert changed[inside].any()
            changed[inside] = False
        assert not changed.any(), f"{name} changed outside the active slice"


def test_arch_outside_a_routed_envelope_is_refused():
    envelope = envelope_layout(TINY, TINY.classes, 1, (1, 1, 1), (1, 1, 1))
    model = Supernet(TINY, layout=envelope)
    fits = Arch((1, 0, 1), (0.5, 1.0, 0.5), (1, 0, 1, 1))
    assert model(_batch(TINY, 2), fits).shape == (2, TINY.classes)
    with pytest.raises(ArchError, match="does not fit this supernet"):
        model(_batch(TINY, 2), Arch((2, 0, 0), (0.5,) * 3, (0,) * 4))


def test_same_seed_same_weights_different_seed_differs():
    a, b, c = Supernet(TINY, seed=3), Supernet(TINY, seed=3), Supernet(TINY, seed=4)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert any(not torch.equal(x, z) for x, z in zip(a.state_dict().values(), c.state_dict().values()))


def test_recalibration_leaves_supernet_untouched_and_sets_cumulative_stats():
    model = Supernet(TINY, seed=0).train()
    arch = Arch((2, 1, 0), (1.0, 0.5, 1.0), (3, 2, 3, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calib = [_batch(TINY, 5, s) * 2 + 0.5 for s in range(4)]
    static = extract_calibrated(model, arch, calib)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"supernet tensor {name} changed"
    assert model.training and not static.training
    # cumulative averaging: the stem BN mean equals the mean over all calibration samples
    with torch.no_grad():
        stem_out = torch.cat([static.stem.conv(x) for x in calib])
    expected = stem_out.mean(dim=(0, 2, 3))
    assert torch.allclose(static.stem.bn.running_mean, expected, atol=1e-5)
