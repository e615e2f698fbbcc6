"""Mixed precision, device-side batches and determinism of local training (feast_edge.local.precision).

The AMP arithmetic runs on the CPU too (torch.autocast("cpu"), torch.amp.GradScaler("cpu")), so the
scaler, the skipped steps and the autocast passes are tested here on every machine; the tests marked
``cuda`` repeat what only a GPU can show and skip, with the reason, where PyTorch sees none.
"""

from __future__ import annotations

import pytest
import torch

from feast_edge.local.augment import BatchAugmenter
from feast_edge.local.batches import training_batches
from feast_edge.local.cotrain import (
    ShapeCache,
    batch_variants,
    cotrain_step,
    local_train,
    make_optimizer,
    plan_variants,
)
from feast_edge.local.precision import (
    AMP_MODES,
    PLAIN,
    AmpError,
    GradientStep,
    Precision,
    check_amp,
    resolve_amp,
    set_deterministic,
    to_device,
)
from feast_edge.local.recipe import TrainConfig
from feast_edge.space.arch import Arch
from feast_edge.space.preset import load_preset_file
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET, tiny_data

TINY = load_preset_file(TINY_PRESET)
A_MIN = Arch.smallest(TINY)
A_MID = Arch((0, 0, 0), (1.0, 0.5, 0.5), (2, 2, 1, 1))
A_MAX = Arch((2, 2, 2), (0.5, 1.0, 1.0), (3, 3, 3, 3))


def cuda(test):
    """A test only a GPU can run: marked ``gpu``, skipped with the reason where PyTorch sees no CUDA device."""
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (PyTorch sees none here)")(test)
    )


pytestmark = pytest.mark.usefixtures("one_thread")


def train(
    amp: str = "off", device: str = "cpu", augment: str = "none", seed: int = 3
) -> tuple[dict[str, torch.Tensor], float]:
    model = Supernet(TINY, seed=0)
    images, labels = tiny_data(48)
    result = local_train(
        model,
        images,
        labels,
        [A_MIN, A_MID, A_MAX],
        A_MIN,
        TrainConfig(batch_size=16, augment=augment),
        lr=0.05,
        seed=seed,
        device=device,
        amp=amp,
    )
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, result.mean_loss


def update_cosine(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Cosine between two local updates (trained weights minus the shared starting weights, BN statistics aside)."""
    start = Supernet(TINY, seed=0).state_dict()
    keys = [k for k in reference if reference[k].is_floating_point() and "running" not in k]
    a = torch.cat([(state[k] - start[k]).flatten() for k in keys])
    b = torch.cat([(reference[k] - start[k]).flatten() for k in keys])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def one_step(
    grad: GradientStep, precision: Precision = PLAIN
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One co-training step of a fresh tiny supernet; returns (weights before, weights after)."""
    model = Supernet(TINY, seed=1)
    images, labels = tiny_data(16, seed=5)
    config = TrainConfig(batch_size=16, augment="none")
    plan = plan_variants(model, [A_MIN, A_MID, A_MAX], A_MIN)
    batch = next(
        training_batches(
            images,
            labels,
            TINY,
            TINY.classes,
            config,
            torch.Generator().manual_seed(0),
            torch.Generator().manual_seed(1),
        )
    )
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    cotrain_step(
        model,
        make_optimizer(model, config, 0.1),
        batch,
        batch_variants(plan, "full", torch.Generator().manual_seed(2)),
        config,
        ShapeCache(model),
        precision,
        grad,
    )
    return before, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ choosing the precision
def test_modes_resolve_on_the_cpu():
    assert resolve_amp("off", "cpu").mode == "off"
    assert (
        resolve_amp("auto", "cpu").mode == "off"
    )  # CPU autocast is slower than float32 on most CPUs: auto leaves it off
    assert resolve_amp("bf16", "cpu") == Precision("bf16", "cpu") and not resolve_amp("bf16", "cpu").scaled
    assert resolve_amp("fp16", "cpu").scaled and resolve_amp("fp16", "cpu").dtype == torch.float16
    assert [check_amp(m) for m in AMP_MODES] == list(AMP_MODES)


def test_an_unknown_mode_names_the_choices():
    with pytest.raises(AmpError, match="--amp 'fp8' is unknown; choose one of off, auto, bf16, fp16"):
        resolve_amp("fp8", "cpu")


# ------------------------------------------------------------------ the gradient scaler
def test_a_power_of_two_scale_steps_exactly_like_float32():
    """Scaling the loss by 2^k and the gradients back by 2^-k is exact in float32: the step must be bit-identical."""
    _, plain = one_step(GradientStep(None))
    _, scaled = one_step(GradientStep(torch.amp.GradScaler("cpu", init_scale=2.0**12)))
    assert all(torch.equal(plain[k], scaled[k]) for k in plain)


def test_an_overflowing_step_is_skipped_and_the_scale_lowered():
    """float16 autocast: a 2^24 scale overflows float16's range in the backward pass (inf gradients)."""
    grad = GradientStep(torch.amp.GradScaler("cpu", init_scale=2.0**24))
    before, after = one_step(grad, Precision("fp16", "cpu"))
    weights = [k for k in before if before[k].is_floating_point() and "running" not in k]
    assert weights and all(torch.equal(before[k], after[k]) for k in weights)  # SGD did not move any weight
    assert grad.skipped == 1 and grad.grad_scaler.get_scale() == 2.0**23
    assert all(torch.isfinite(after[k]).all() for k in weights)


def test_a_scale_in_float16_range_steps():
    grad = GradientStep(torch.amp.GradScaler("cpu", init_scale=2.0**8))
    before, after = one_step(grad, Precision("fp16", "cpu"))
    assert grad.skipped == 0 and any(not torch.equal(before[k], after[k]) for k in before if "running" not in k)


# ------------------------------------------------------------------ autocast training
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_training_stays_close_to_float32_with_float32_weights(amp):
    reference, ref_loss = train("off")
    mixed, loss = train(amp)
    assert all(v.dtype == reference[k].dtype for k, v in mixed.items())  # master weights and BN statistics stay float32
    assert all(torch.isfinite(v).all() for v in mixed.values() if v.is_floating_point())
    changed = [k for k in reference if reference[k].is_floating_point() and not torch.equal(reference[k], mixed[k])]
    assert changed  # the passes really ran in the lower precision
    assert abs(loss - ref_loss) < 0.05 * abs(ref_loss)
    agreement = update_cosine(mixed, reference)  # three SGD steps with momentum: rounding differences compound
    assert agreement > 0.5, (
        f"{amp}'s local round moved elsewhere than float32's (cosine {agreement:.3f}; unrelated updates give ~0)"
    )


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_one_mixed_precision_step_follows_the_float32_gradient(amp):
    start, plain = one_step(GradientStep(None))
    precision = Precision(amp, "cpu")
    _, mixed = one_step(precision.scaler(), precision)
    keys = [k for k in start if start[k].is_floating_point() and "running" not in k]
    a, b = (torch.cat([(s[k] - start[k]).flatten() for k in keys]) for s in (mixed, plain))
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.9


def test_float32_training_is_bit_reproducible_on_the_cpu():
    first, _ = train("off", augment="randaugment+mix")
    again, _ = train("off", augment="randaugment+mix")
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_deterministic_kernels_train_the_same_weights_on_the_cpu():
    """--deterministic must not break CPU training (no op without a deterministic kernel) nor change its result."""
    reference, _ = train("off", augment="randaugment+mix")
    set_deterministic(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        strict, _ = train("off", augment="randaugment+mix")
    finally:
        set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(reference[k], strict[k]) for k in reference)


# ------------------------------------------------------------------ CUDA (skip without a GPU)
@cuda
def test_auto_picks_bf16_where_the_gpu_has_it_else_fp16_with_a_scaler():
    precision = resolve_amp("auto", "cuda")
    assert precision.mode == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
    assert precision.scaled == (precision.mode == "fp16")


@cuda
def test_pinned_non_blocking_copy_arrives_intact():
    host = torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8)
    moved = to_device(host, torch.device("cuda"))
    torch.cuda.synchronize()
    assert moved.is_cuda and torch.equal(moved.cpu(), host)


@cuda
def test_augmentation_on_the_gpu_draws_what_the_cpu_draws():
    images, labels = tiny_data(32)
    augmenter = BatchAugmenter(TINY.mean, TINY.std, TINY.classes)
    on_cpu = augmenter(images, labels, 0, torch.Generator().manual_seed(9))
    on_gpu = augmenter(images.cuda(), labels.cuda(), 0, torch.Generator().manual_seed(9))
    assert on_gpu.images.is_cuda and on_gpu.mixer == on_cpu.mixer
    assert torch.allclose(on_gpu.targets.cpu(), on_cpu.targets, atol=1e-6)  # same mixing partner and λ
    assert (
        float((on_gpu.images.cpu() - on_cpu.images).abs().mean()) < 0.05
    )  # same ops; interpolation may round differently


@cuda
@pytest.mark.parametrize("amp", ["off", "auto"])
def test_cuda_training_with_and_without_amp_stays_close_to_the_cpu(amp):
    reference, ref_loss = train("off", "cpu")
    gpu, loss = train(amp, "cuda")
    assert abs(loss - ref_loss) < 0.05 * abs(ref_loss)
    assert update_cosine(gpu, reference) > 0.5


@cuda
def test_deterministic_kernels_make_cuda_runs_bit_identical():
    set_deterministic(True)
    try:
        first, _ = train("off", "cuda", augment="randaugment+mix")
        again, _ = train("off", "cuda", augment="randaugment+mix")
    finally:
        set_deterministic(False)
    assert all(torch.equal(first[k], again[k]) for k in first)
