"""Local multi-variant co-training, one client and one round (method §7)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms import v2

from feast_edge.data.images import load_fashion_mnist, normalize
from feast_edge.errors import ArchError
from feast_edge.local.cotrain import add_masked_weight_decay, kd_loss, local_train, plan_variants
from feast_edge.local.recipe import VARIANT_MODES, TrainConfig, TrainError, cosine_lr
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.extract import extract_calibrated
from feast_edge.space.geometry import envelope_layout
from feast_edge.space.preset import load_preset, load_preset_file
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET, archs, tiny_data

TINY = load_preset_file(TINY_PRESET)
# Three tiny variants with strictly increasing MACs. A_MID's stage-1 mid width
# (16) exceeds A_MAX's (8), so A_MID owns a region no other variant touches.
A_MIN = Arch.smallest(TINY)
A_MID = Arch((0, 0, 0), (1.0, 0.5, 0.5), (2, 2, 1, 1))
A_MAX = Arch((2, 2, 2), (0.5, 1.0, 1.0), (3, 3, 3, 3))
EXCLUSIVE_TO_MID = ("stages.0.0.conv1.weight", slice(8, 16))
EXPECTED = {
    "min": {A_MIN},
    "max": {A_MAX},
    "min+max": {A_MIN, A_MAX},
    "min+max+kd": {A_MIN, A_MAX},
    "full": {A_MIN, A_MID, A_MAX},
}


pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def union_masks(model: Supernet, trained: set[Arch]) -> dict[str, torch.Tensor]:
    """Per state-dict entry, the union of the leading slices the trained variants activate (shared names)."""
    masks = {k: torch.zeros_like(v, dtype=torch.bool) for k, v in snapshot(model).items()}
    for arch in trained:
        for name, t in StaticResNet(model.active_layout(arch)).state_dict().items():
            if name in masks:
                masks[name][tuple(slice(0, n) for n in t.shape)] = True
    return masks


def moved_outside(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]
) -> list[str]:
    return [k for k in before if not torch.equal(before[k][~masks[k]], after[k][~masks[k]])]


def train_tiny(variants: str = "full", affordable=(A_MIN, A_MID, A_MAX), seed: int = 0, n: int = 40, **config):
    model = Supernet(TINY, seed=0)
    images, labels = tiny_data(n)
    cfg = TrainConfig(variants=variants, batch_size=16, **config)
    result = local_train(model, images, labels, list(affordable), A_MIN, cfg, lr=0.05, seed=seed)
    return model, result


# ------------------------------------------------------------------ config and schedule
def test_config_defaults_are_the_papers():
    c = TrainConfig()
    assert (c.lr, c.momentum, c.weight_decay, c.clip_norm, c.kd_weight, c.temperature) == (
        0.025,
        0.9,
        1e-4,
        10.0,
        0.5,
        1.0,
    )
    assert (c.batch_size, c.epochs, c.mixup_alpha, c.cutmix_alpha, c.randaugment) == (64, 1, 0.4, 1.0, (2, 6))
    assert c.variants == "full" and c.augment


def test_config_rejects_unknown_ablation():
    with pytest.raises(TrainError, match="min\\+max\\+kd"):
        TrainConfig(variants="random")


def test_cosine_lr_decays_over_the_horizon():
    lrs = [cosine_lr(0.025, t, 100) for t in range(100)]
    assert lrs[0] == 0.025
    assert math.isclose(lrs[50], 0.0125)
    assert all(a > b > 0 for a, b in zip(lrs, lrs[1:]))
    with pytest.raises(TrainError):
        cosine_lr(0.025, 100, 100)


# ------------------------------------------------------------------ variant plan
def test_plan_sorts_by_macs_and_keeps_strictly_intermediate_variants():
    model = Supernet(TINY, seed=None)
    plan = plan_variants(model, [A_MAX, A_MIN, A_MID], A_MIN)
    assert (plan.a_min, plan.a_max, plan.intermediate) == (A_MIN, A_MAX, (A_MID,))
    assert plan_variants(model, [A_MIN], A_MIN).intermediate == ()
    with pytest.raises(TrainError, match="empty"):
        plan_variants(model, [], A_MIN)
    with pytest.raises(TrainError, match="global_min"):
        plan_variants(model, [A_MIN], A_MAX)


# ------------------------------------------------------------------ reproducibility
def test_same_seed_is_bit_identical_and_another_seed_differs():
    a, ra = train_tiny(seed=3)
    b, rb = train_tiny(seed=3)
    c, _ = train_tiny(seed=4)
    sa, sb, sc = snapshot(a), snapshot(b), snapshot(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ra == rb
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_training_leaves_the_callers_global_rng_alone():
    model = Supernet(TINY, seed=0)  # (building modules draws from the global RNG; training must not)
    images, labels = tiny_data(40)
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    local_train(model, images, labels, [A_MIN, A_MID, A_MAX], A_MIN, TrainConfig(batch_size=16), seed=0)
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------ which slices move
@settings(max_examples=8, deadline=None)
@given(st.lists(archs(TINY), min_size=1, max_size=4, unique=True), st.sampled_from(VARIANT_MODES))
def test_only_the_trained_variants_slices_move(candidates, mode):
    macs = {a: arch_cost(TINY, a)[0] for a in candidates}
    global_min = min(candidates, key=lambda a: macs[a])
    model = Supernet(TINY, seed=0)
    before = snapshot(model)
    images, labels = tiny_data(24)
    result = local_train(
        model, images, labels, candidates, global_min, TrainConfig(variants=mode, batch_size=16), seed=1
    )
    trained = set(result.arch_batches)
    assert moved_outside(before, snapshot(model), union_masks(model, trained)) == []


@pytest.mark.parametrize("mode", VARIANT_MODES)
def test_each_ablation_trains_exactly_the_variants_it_names(mode):
    base = snapshot(Supernet(TINY, seed=0))
    model, result = train_tiny(mode)
    expected = EXPECTED[mode]
    assert set(result.arch_batches) == expected
    assert all(count == result.num_batches for count in result.arch_batches.values())
    assert result.variants_per_batch == {len(expected): result.num_batches}
    after = snapshot(model)
    assert moved_outside(base, after, union_masks(model, expected)) == []
    name, region = EXCLUSIVE_TO_MID
    assert torch.equal(base[name][region], after[name][region]) == (A_MID not in expected)


def test_kd_is_what_separates_min_max_from_min_max_kd():
    plain, _ = train_tiny("min+max")
    no_kd_weight, _ = train_tiny("min+max+kd", kd_weight=0.0)
    with_kd, _ = train_tiny("min+max+kd")
    p, z, k = snapshot(plain), snapshot(no_kd_weight), snapshot(with_kd)
    assert all(torch.equal(p[n], z[n]) for n in p)
    assert any(not torch.equal(p[n], k[n]) for n in p)


def test_full_without_intermediate_variants_is_min_max_kd():
    full, rf = train_tiny("full", affordable=(A_MIN, A_MAX))
    kd, rk = train_tiny("min+max+kd", affordable=(A_MIN, A_MAX))
    f, k = snapshot(full), snapshot(kd)
    assert all(torch.equal(f[n], k[n]) for n in f)
    assert rf.variants_per_batch == rk.variants_per_batch == {2: rf.num_batches}


def test_single_affordable_variant_trains_only_a_min():
    base = snapshot(Supernet(TINY, seed=0))
    full, result = train_tiny("full", affordable=(A_MIN,))
    only_min, _ = train_tiny("min", affordable=(A_MIN,))
    assert result.arch_batches == {A_MIN: result.num_batches}
    assert result.variants_per_batch == {1: result.num_batches}
    f, m = snapshot(full), snapshot(only_min)
    assert all(torch.equal(f[n], m[n]) for n in f)
    assert moved_outside(base, f, union_masks(full, {A_MIN})) == []


def test_weight_decay_covers_exactly_the_union_of_non_nested_slices():
    p = torch.nn.Parameter(torch.arange(1.0, 17.0).view(4, 4))
    p.grad = torch.zeros(4, 4)
    add_masked_weight_decay({"w": p}, [{"w": (4, 2)}, {"w": (2, 4)}, {}], weight_decay=0.5)
    union = torch.zeros(4, 4, dtype=torch.bool)
    union[:, :2] = union[:2, :] = True
    assert torch.equal(p.grad, torch.where(union, 0.5 * p.detach(), torch.zeros(4, 4)))


def test_kd_is_cross_entropy_against_the_teachers_soft_labels():
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    p_hat = F.softmax(t, dim=1)
    expected = -(p_hat * F.log_softmax(z, dim=1)).sum(1).mean()
    assert torch.allclose(kd_loss(z, p_hat), expected)


# ------------------------------------------------------------------ bookkeeping
def test_compute_proxy_and_partial_last_batch():
    _, result = train_tiny("full", n=40)  # batches of 16, 16, 8: the partial batch is kept
    assert (result.num_batches, result.samples_seen, result.num_samples) == (3, 40, 40)
    macs = sum(arch_cost(TINY, a)[0] for a in (A_MIN, A_MID, A_MAX))
    assert result.train_macs == 3 * 40 * macs
    _, only_max = train_tiny("max", n=40)
    assert only_max.train_macs == 3 * 40 * arch_cost(TINY, A_MAX)[0]


def test_a_final_single_sample_batch_is_kept_unless_bn_would_see_one_value():
    _, kept = train_tiny("full", n=33)  # last feature map 4x4: a 1-sample batch trains fine
    assert (kept.num_batches, kept.samples_seen) == (3, 33)
    pointwise = dataclasses.replace(TINY, name="test-1x1", input_size=4)  # last feature map 1x1
    model = Supernet(pointwise, seed=0)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (17, 1, 4, 4), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, pointwise.classes, (17,), generator=g)
    result = local_train(model, images, labels, [A_MIN, A_MAX], A_MIN, TrainConfig(batch_size=16), seed=0)
    assert (result.num_batches, result.samples_seen, result.num_samples) == (1, 16, 17)


def test_training_alternates_torchvision_mixup_and_cutmix(monkeypatch):
    calls: list[str] = []
    for cls in (v2.MixUp, v2.CutMix):
        original = cls.forward
        monkeypatch.setattr(
            cls, "forward", lambda self, *x, _o=original, _n=cls.__name__: calls.append(_n) or _o(self, *x)
        )
    _, result = train_tiny("min", n=64)
    assert calls == ["MixUp", "CutMix", "MixUp", "CutMix"] and result.num_batches == 4


def test_trains_a_routed_sub_supernet_and_rejects_unrouted_variants():
    layout = envelope_layout(TINY, TINY.classes, A_MID.w[0], A_MID.d, A_MID.w[1:])
    model = Supernet(TINY, layout=layout, seed=0)
    images, labels = tiny_data(20)
    result = local_train(model, images, labels, [A_MIN, A_MID], A_MIN, TrainConfig(batch_size=8), seed=0)
    assert result.variants_per_batch == {2: 3}
    with pytest.raises(ArchError, match="affordable"):
        local_train(model, images, labels, [A_MIN, A_MAX], A_MIN, TrainConfig(batch_size=8), seed=0)


def test_rejects_labels_outside_the_models_classes():
    model = Supernet(TINY, seed=None)
    images, labels = tiny_data(8)
    with pytest.raises(TrainError, match="0..4"):
        local_train(model, images, labels + TINY.classes, [A_MIN], A_MIN)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_cuda_and_matches_cpu_closely(full_float32):
    cpu, rc = train_tiny(seed=2, augment=False)
    model = Supernet(TINY, seed=0)
    images, labels = tiny_data(40)
    rg = local_train(
        model,
        images,
        labels,
        [A_MIN, A_MID, A_MAX],
        A_MIN,
        TrainConfig(batch_size=16, augment=False),
        lr=0.05,
        seed=2,
        device="cuda",
    )
    assert rg.arch_batches == rc.arch_batches and rg.train_macs == rc.train_macs
    c, g = snapshot(cpu), {k: v.cpu() for k, v in snapshot(model).items()}
    assert all(torch.allclose(c[k], g[k], atol=1e-3) for k in c)


# ------------------------------------------------------------------ real behaviour
@pytest.mark.slow
def test_co_training_on_fashion_mnist_lowers_held_out_loss(fashion_mnist_dir):
    preset = load_preset("fmnist-small")
    train, test = load_fashion_mnist(fashion_mnist_dir, "train"), load_fashion_mnist(fashion_mnist_dir, "test")
    a_min = Arch.smallest(preset)
    a_mid = Arch((0, 0, 0, 0), (0.5,) * 4, (1,) * 5)
    a_max = Arch((0, 0, 1, 1), (0.5,) * 4, (2,) * 5)
    model = Supernet(preset, seed=0)
    pixels = lambda images: normalize(images.float() / 255, preset.mean, preset.std)  # noqa: E731
    calibration = pixels(train.images[-512:]).split(128)
    x_test, y_test = pixels(test.images[:1000]), test.labels[:1000]

    def held_out_loss(arch: Arch) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(extract_calibrated(model, arch, calibration)(x_test), y_test))

    before = [held_out_loss(a) for a in (a_min, a_max)]
    steps, batch = 60, 32
    result = local_train(
        model,
        train.images[: steps * batch],
        train.labels[: steps * batch],
        [a_min, a_mid, a_max],
        a_min,
        TrainConfig(batch_size=batch),
        seed=0,
    )
    after = [held_out_loss(a) for a in (a_min, a_max)]
    assert result.num_batches == steps and result.variants_per_batch == {3: steps}
    assert before[0] > 2.0 and before[1] > 2.0  # chance level for 10 classes is ln 10 = 2.30
    assert after[0] < 0.75 * before[0] and after[1] < 0.75 * before[1], (before, after)


# ------------------------------------------------------------------ restricted softmax (issue 37)
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0])
def test_a_restricted_softmax_stops_pushing_down_the_classes_a_client_never_saw(scale: float, device: str) -> None:
    model = Supernet(TINY, seed=0)
    images, labels = tiny_data(40)
    labels = labels % 3  # the client holds classes 0, 1 and 2 only
    before = snapshot(model)
    cfg = TrainConfig(batch_size=16, weight_decay=0.0, absent_logit_scale=scale)
    local_train(model, images, labels, [A_MIN, A_MID, A_MAX], A_MIN, cfg, lr=0.05, seed=0, device=device)
    after = {k: v.cpu() for k, v in snapshot(model).items()}
    absent = slice(3, None)
    moved = {k: not torch.equal(before[k][absent], after[k][absent]) for k in ("classifier.weight", "classifier.bias")}
    # scale 0: the absent classes' logits leave the loss, so no gradient reaches their classifier rows; otherwise the
    # plain softmax (and FedRS's 0.5) keeps lowering them.
    assert moved == dict.fromkeys(moved, scale != 0.0)
    assert not torch.equal(before["classifier.weight"][:3], after["classifier.weight"][:3])  # the held classes learn


def test_a_restricted_softmax_changes_nothing_for_a_client_holding_every_class() -> None:
    plain, _ = train_tiny(weight_decay=0.0)
    restricted, _ = train_tiny(weight_decay=0.0, absent_logit_scale=0.5)
    labels = tiny_data(40)[1]
    assert set(labels.tolist()) == set(range(TINY.classes))  # tiny_data holds every class
    sp, sr = snapshot(plain), snapshot(restricted)
    assert all(torch.equal(sp[k], sr[k]) for k in sp)


def test_the_restricted_softmax_setting_is_checked_and_sent_only_when_set() -> None:
    with pytest.raises(TrainError, match="absent_logit_scale"):
        TrainConfig(absent_logit_scale=1.5)
    # method §7's value is left out: earlier agents and fingerprints unchanged
    assert "absent_logit_scale" not in TrainConfig().settings()
    assert TrainConfig(**TrainConfig(absent_logit_scale=0.5).settings()).absent_logit_scale == 0.5
