"""Mixed precision, device-side batches and determinism of local training (feast_edge.local.precision).

The AMP arithmetic runs on the CPU too (torch.autocast("cpu"), torch.amp.GradScaler("cpu")), so the
scaler, the skipped steps and the autocast passes are tested here on every machine; the tests marked
``cuda`` repeat what only a GPU can show and skip, with the reason, where PyTorch sees none.
"""

from __future__ import annotations

import pytest
import torch

from feast_edge.local import precision as precision_module
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
    _native_bf16_from_cpuinfo,
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
    assert resolve_amp("bf16", "cpu") == Precision("bf16", "cpu") and not resolve_amp("bf16", "cpu").scaled
    assert resolve_amp("fp16", "cpu").scaled and resolve_amp("fp16", "cpu").dtype == torch.float16
    assert [check_amp(m) for m in AMP_MODES] == list(AMP_MODES)


# The "flags" / "Features" line of /proc/cpuinfo on real machines (the Intel and Arm ones shortened).
ZEN3_FLAGS = (  # AMD EPYC Zen 3: AVX2, no AVX-512, so bfloat16 is emulated
    "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx lm constant_tsc pni "
    "pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm sse4a "
    "bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves "
    "vaes vpclmulqdq rdpid fsrm"
)
ICELAKE_FLAGS = "flags\t\t: fpu sse sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
COOPERLAKE_FLAGS = ICELAKE_FLAGS + " avx512_bf16"
SAPPHIRE_RAPIDS_FLAGS = COOPERLAKE_FLAGS.replace("avx512_bf16", "amx_bf16 amx_tile amx_int8")
NEOVERSE_N1_FEATURES = (  # Graviton2: no BF16 extension
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
)
NEOVERSE_V1_FEATURES = (  # Graviton3: the BF16 extension (bf16; svebf16 is its SVE form)
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc "
    "dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 "
    "i8mm bf16 dgh rng"
)


def cpuinfo(flags_line: str) -> str:
    """Two processors' /proc/cpuinfo entries around ``flags_line`` (the parser must find it among the other lines)."""
    entry = f"processor\t: {{}}\nmodel name\t: some CPU\ncpu MHz\t\t: 2000.0\n{flags_line}\nbogomips\t: 4000.00\n"
    return "\n".join(entry.format(n) for n in range(2))


@pytest.mark.parametrize(
    ("text", "machine", "flag"),
    [
        pytest.param(cpuinfo(COOPERLAKE_FLAGS), "x86_64", "avx512_bf16", id="cooper-lake"),
        pytest.param(cpuinfo(SAPPHIRE_RAPIDS_FLAGS), "x86_64", "amx_bf16", id="sapphire-rapids"),
        # AVX-512 without BF16: oneDNN calls bf16 "supported" there, but emulates it slower than float32
        pytest.param(cpuinfo(ICELAKE_FLAGS), "x86_64", None, id="ice-lake"),
        pytest.param(cpuinfo(ZEN3_FLAGS), "x86_64", None, id="zen3"),
        pytest.param(cpuinfo(NEOVERSE_V1_FEATURES), "aarch64", "bf16", id="neoverse-v1"),
        pytest.param(cpuinfo(NEOVERSE_N1_FEATURES), "aarch64", None, id="neoverse-n1"),
        pytest.param(cpuinfo(COOPERLAKE_FLAGS), "riscv64", None, id="unknown-platform"),
        pytest.param("", "x86_64", None, id="empty"),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(text, machine, flag):
    assert _native_bf16_from_cpuinfo(text, machine) == flag


@pytest.mark.parametrize(
    ("written", "native"),
    [
        pytest.param(COOPERLAKE_FLAGS, True, id="cooper-lake"),
        pytest.param(ZEN3_FLAGS, False, id="zen3"),
        pytest.param(None, False, id="missing"),
    ],
)
def test_the_cpu_check_reads_proc_cpuinfo_once(monkeypatch, tmp_path, written, native):
    """The answer comes from the file (missing: no native bf16) and is cached: a later change of the file is not read."""
    cpuinfo_file = tmp_path / "cpuinfo"
    if written is not None:
        cpuinfo_file.write_text(cpuinfo(written))
    monkeypatch.setattr(precision_module, "_CPUINFO", cpuinfo_file)
    monkeypatch.setattr(precision_module.platform, "machine", lambda: "x86_64")
    precision_module.cpu_has_native_bf16.cache_clear()
    try:
        assert precision_module.cpu_has_native_bf16() is native
        cpuinfo_file.write_text(cpuinfo(ZEN3_FLAGS if native else COOPERLAKE_FLAGS))
        assert precision_module.cpu_has_native_bf16() is native
    finally:
        precision_module.cpu_has_native_bf16.cache_clear()  # the next call reads the real /proc/cpuinfo again


def test_auto_on_a_cpu_with_native_bf16_trains_in_bf16_with_float32_weights(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: True)
    precision = resolve_amp("auto", "cpu")
    assert precision == Precision("bf16", "cpu") and not precision.scaled
    assert precision.describe() == "bf16 autocast (auto: the CPU has native bfloat16)"
    start, after = one_step(precision.scaler(), precision)
    _, plain = one_step(GradientStep(None))
    weights = [k for k in start if start[k].is_floating_point()]
    assert all(after[k].dtype == torch.float32 for k in weights)  # weights and BN statistics stay float32
    assert any(not torch.equal(after[k], plain[k]) for k in weights)  # the step really ran in bfloat16


def test_auto_on_a_cpu_without_native_bf16_stays_float32(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: False)
    precision = resolve_amp("auto", "cpu")
    assert precision == Precision("off", "cpu") and precision.dtype is None
    assert precision.describe() == "float32 (auto: the CPU has no native bfloat16)"


@pytest.mark.parametrize("native", [True, False])
def test_explicit_modes_ignore_the_cpu_flags(monkeypatch, native):
    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: native)
    assert resolve_amp("off", "cpu") == Precision("off", "cpu") and resolve_amp("off", "cpu").describe() == "float32"
    assert resolve_amp("bf16", "cpu") == Precision("bf16", "cpu")
    assert resolve_amp("fp16", "cpu") == Precision("fp16", "cpu")


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
