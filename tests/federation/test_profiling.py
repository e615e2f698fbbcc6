"""Device profiling: latency fit, training-memory estimate, budget derivation, measuring a device (issue 4, item 2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from rich.console import Console
from timers import noise_free
from torch import nn

from feast_edge.agent.profile_view import profile_table
from feast_edge.agent.profiling import profile_device, read_hardware, time_variant
from feast_edge.budget.profile import (
    DeviceProfile,
    ProfileError,
    activation_elements,
    derive_budget,
    fit_latency,
    training_memory_bytes,
)
from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.local.torch_device import DeviceError
from feast_edge.route.envelope import Envelope
from feast_edge.space.extract import extract
from feast_edge.space.preset import Preset, load_preset
from feast_edge.space.supernet import Supernet
from strategies import archs

torch.set_num_threads(1)

NO_LIMIT = 1 << 50  # bytes: a memory limit that never binds


@pytest.fixture(scope="module")
def fmnist() -> Preset:
    return load_preset("fmnist-small")


@pytest.fixture(scope="module")
def cache(fmnist: Preset) -> VariantCache:
    return load_cache(fmnist)


def envelope_memory(cache: VariantCache, preset: Preset, budget: float, batch_size: int = 64) -> int:
    """Training memory of the envelope routed at ``budget``, from the public pieces."""
    affordable = [e.arch for e in cache.affordable(budget)]
    return training_memory_bytes(
        preset, Envelope.of(affordable).params(preset, cache.classes), batch_size, affordable, cache.classes
    )


def render(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


# ------------------------------------------------------------------ fit_latency
def test_fit_recovers_a_known_line_exactly() -> None:
    a, b = 1.25, 0.5  # ms, ms per million MACs
    points = [(m, a + b * m / 1e6) for m in (1.4e6, 5e6, 12e6, 39e6)]
    fit_a, fit_b = fit_latency(points)
    assert fit_a == pytest.approx(a, rel=1e-12)
    assert fit_b == pytest.approx(b, rel=1e-12)


def test_fit_with_negative_intercept_goes_through_the_origin() -> None:
    # Unconstrained least squares gives a = -0.8, b = 0.9; the optimum under a >= 0 is b = Σxy/Σx².
    points = [(1e6, 0.1), (2e6, 1.0), (3e6, 1.9)]
    a, b = fit_latency(points)
    assert a == 0.0
    assert b == pytest.approx((1 * 0.1 + 2 * 1.0 + 3 * 1.9) / (1 + 4 + 9), rel=1e-12)


def test_fit_needs_two_distinct_mac_counts() -> None:
    with pytest.raises(ProfileError, match="at least 2 variants"):
        fit_latency([(5e6, 1.0), (5e6, 1.2)])


def test_fit_rejects_latency_that_falls_with_macs() -> None:
    with pytest.raises(ProfileError, match="does not grow with MACs"):
        fit_latency([(1e6, 3.0), (2e6, 2.0), (3e6, 1.0)])


# ------------------------------------------------------------------ memory estimate
def test_activation_elements_equal_conv_and_linear_outputs_of_the_extracted_model(
    fmnist: Preset, cache: VariantCache
) -> None:
    supernet = Supernet(fmnist, classes=cache.classes, seed=0)
    for entry in (cache.smallest, cache.entries[len(cache) // 2], cache.largest):
        model = extract(supernet, entry.arch)
        counted = []
        hooks = [
            m.register_forward_hook(lambda _m, _i, out: counted.append(out.numel()))
            for m in model.modules()
            if isinstance(m, (nn.Conv2d, nn.Linear))
        ]
        with torch.no_grad():
            model(torch.zeros(1, 1, 28, 28))
        for h in hooks:
            h.remove()
        assert activation_elements(fmnist, entry.arch, cache.classes) == sum(counted)


@settings(max_examples=15, deadline=None)
@given(data=archs(load_preset("fmnist-small")))
def test_training_memory_follows_the_documented_formula(data) -> None:
    preset = load_preset("fmnist-small")
    elements = activation_elements(preset, data)
    memory = training_memory_bytes(preset, 1000, 8, [data])
    assert memory == 3 * 4 * 1000 + 2 * 4 * 8 * elements


def test_training_memory_uses_the_largest_activations_of_the_affordable_set(
    fmnist: Preset, cache: VariantCache
) -> None:
    archs_ = [e.arch for e in cache.entries[:5]]
    peak = max(activation_elements(fmnist, a, cache.classes) for a in archs_)
    assert training_memory_bytes(fmnist, 12345, 64, archs_, cache.classes) == 12 * 12345 + 8 * 64 * peak
    with pytest.raises(ProfileError, match="empty affordable set"):
        training_memory_bytes(fmnist, 12345, 64, [])


def test_training_memory_grows_with_the_budget(fmnist: Preset, cache: VariantCache) -> None:
    # Nested affordable sets (method §5) make the estimate monotone, so the affordable budgets are a prefix.
    memories = [envelope_memory(cache, fmnist, e.macs) for e in cache.entries]
    assert memories == sorted(memories)


# ------------------------------------------------------------------ derive_budget
def test_latency_binds(fmnist: Preset, cache: VariantCache) -> None:
    a, b = 1.0, 0.1
    k = 10
    exact = a + b * cache.entries[k].macs / 1e6
    assert derive_budget(cache, fmnist, a, b, exact, NO_LIMIT) == cache.entries[k].macs
    assert derive_budget(cache, fmnist, a, b, exact - 1e-6, NO_LIMIT) == cache.entries[k - 1].macs


def test_memory_binds(fmnist: Preset, cache: VariantCache) -> None:
    k = 10
    need = envelope_memory(cache, fmnist, cache.entries[k].macs)
    assert need > envelope_memory(cache, fmnist, cache.entries[k - 1].macs)
    assert derive_budget(cache, fmnist, 1.0, 0.1, 1e9, need) == cache.entries[k].macs
    assert derive_budget(cache, fmnist, 1.0, 0.1, 1e9, need - 1) == cache.entries[k - 1].macs


def test_budget_meets_both_limits_at_once(fmnist: Preset, cache: VariantCache) -> None:
    a, b = 1.0, 0.1
    latency_only = derive_budget(cache, fmnist, a, b, a + b * cache.entries[15].macs / 1e6, NO_LIMIT)
    memory_only = derive_budget(cache, fmnist, a, b, 1e9, envelope_memory(cache, fmnist, cache.entries[8].macs))
    both = derive_budget(
        cache, fmnist, a, b, a + b * cache.entries[15].macs / 1e6, envelope_memory(cache, fmnist, cache.entries[8].macs)
    )
    assert both == min(latency_only, memory_only) == cache.entries[8].macs


def test_budget_of_a_fast_device_is_the_largest_variant(fmnist: Preset, cache: VariantCache) -> None:
    assert derive_budget(cache, fmnist, 0.1, 0.001, 1000.0, NO_LIMIT) == cache.largest.macs


def test_smallest_variant_missing_the_latency_target_is_a_clear_error(fmnist: Preset, cache: VariantCache) -> None:
    with pytest.raises(ProfileError) as exc:
        derive_budget(cache, fmnist, 2.0, 0.1, 1.0, NO_LIMIT)
    message = str(exc.value)
    assert "1.45M MACs" in message and "latency target 1 ms" in message
    assert "raise --latency-target-ms to at least 2.145" in message and "smaller variants" in message
    assert "memory limit" not in message


def test_smallest_variant_missing_the_memory_limit_is_a_clear_error(fmnist: Preset, cache: VariantCache) -> None:
    with pytest.raises(ProfileError) as exc:
        derive_budget(cache, fmnist, 0.5, 0.1, 100.0, 1 << 20)
    message = str(exc.value)
    assert "memory limit is 1.0 MiB" in message and "--memory-fraction" in message
    assert "latency target" not in message


def test_derive_budget_rejects_bad_inputs(fmnist: Preset, cache: VariantCache, tiny: Preset) -> None:
    with pytest.raises(ProfileError, match="b > 0"):
        derive_budget(cache, fmnist, 1.0, 0.0, 10.0, NO_LIMIT)
    with pytest.raises(ProfileError, match="belongs to preset fmnist-small, not test-tiny"):
        derive_budget(cache, tiny, 1.0, 0.1, 10.0, NO_LIMIT)


# ------------------------------------------------------------------ measuring
def test_time_variant_returns_a_positive_median() -> None:
    ms = time_variant(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()), (1, 1, 8, 8), "cpu", repeats=3, warmup=1)
    assert ms > 0 and math.isfinite(ms)


def test_time_variant_rejects_bad_settings() -> None:
    with pytest.raises(ProfileError, match="repeats >= 1"):
        time_variant(nn.Identity(), (1, 1), "cpu", repeats=0, warmup=0)
    with pytest.raises(DeviceError, match="'tpu' is not one of auto, cpu, cuda"):
        time_variant(nn.Identity(), (1, 1), "tpu", repeats=1, warmup=0)


def test_read_hardware_reports_cores_ram_and_torch() -> None:
    hardware = read_hardware("cpu")
    assert hardware["cores"] >= 1 and hardware["ram_bytes"] > hardware["available_ram_bytes"] > 0
    assert hardware["torch"] == torch.__version__ and "cuda_name" not in hardware


@pytest.mark.slow  # times every variant
def test_profile_device_on_cpu_is_consistent(fmnist: Preset, cache: VariantCache) -> None:
    """The default: each variant exported to ONNX on the fly and timed in onnxruntime (what serves it), two held out of the fit."""
    calls = []
    # A generous target: the check is consistency, not how fast this (shared) machine is.
    profile = profile_device(
        "fmnist-small",
        "cpu",
        latency_target_ms=1e4,
        variants=3,
        repeats=3,
        holdout=2,
        threads=1,
        name="test-cpu",
        progress=lambda d, n: calls.append((d, n)),
    )
    assert calls == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]
    assert [m for m, _ in profile.measurements] == [
        cache.smallest.macs,
        cache.entries[len(cache) // 2].macs,
        cache.largest.macs,
    ]
    held = [m for m, _ in profile.holdout]
    assert (
        len(held) == 2
        and not set(held) & {m for m, _ in profile.measurements}
        and set(held) <= {e.macs for e in cache.entries}
    )
    assert all(ms > 0 for _, ms in profile.measurements + profile.holdout)
    assert (
        profile.runtime.startswith("onnxruntime ")
        and "CPUExecutionProvider" in profile.runtime
        and "1 intra-op" in profile.runtime
    )
    assert profile.holdout_errors() == [abs(profile.latency_ms(m) - ms) / ms for m, ms in profile.holdout]
    assert profile.latency_b_ms_per_mmac > 0 and profile.latency_a_ms >= 0
    assert (profile.latency_a_ms, profile.latency_b_ms_per_mmac) == fit_latency(profile.measurements)
    assert profile.budget_macs in {e.macs for e in cache.entries}
    assert profile.budget_macs == derive_budget(
        cache,
        fmnist,
        profile.latency_a_ms,
        profile.latency_b_ms_per_mmac,
        profile.latency_target_ms,
        profile.memory_limit_bytes,
    )
    assert 0 < profile.memory_limit_bytes <= profile.hardware["ram_bytes"] // 2
    assert profile.source.startswith("measured on ") and profile.name == "test-cpu" and profile.device == "cpu"
    assert DeviceProfile.from_dict(profile.to_dict()) == profile
    text = render(profile_table(profile))
    assert (
        "test-cpu" in text
        and f"{profile.budget_macs / 1e6:.2f}M MACs" in text
        and str(cache.largest_affordable(profile.budget_macs).arch) in text
    )
    assert "held out" in text and "error" in text and "onnxruntime" in text


def _profiled(**settings):
    """``profile_device`` on this (shared, perhaps loaded) machine: its noise check may refuse timings that other
    work on the same cores made decrease with MACs, as it should; measured again up to twice then."""
    for attempt in range(3):
        try:
            return profile_device("fmnist-small", "cpu", **settings)
        except ProfileError as exc:
            if "dominated by noise" not in str(exc) or attempt == 2:
                raise


def test_profile_device_times_pytorch_eager_on_request(cache: VariantCache) -> None:
    profile = _profiled(latency_target_ms=1e4, variants=2, repeats=2, holdout=0, runtime="torch", name="eager")
    assert profile.runtime.startswith("PyTorch ") and "eager" in profile.runtime and not profile.holdout
    assert [m for m, _ in profile.measurements] == [cache.smallest.macs, cache.largest.macs]
    one = _profiled(latency_target_ms=1e4, variants=2, repeats=1, holdout=1, runtime="torch", name="one")
    assert [m for m, _ in one.holdout] == [
        cache.entries[1 + (len(cache) - 3) // 2].macs
    ]  # one held out: the middle of the rest


def test_unknown_runtime_or_missing_provider_is_a_clear_error() -> None:
    import onnxruntime as ort

    with pytest.raises(ProfileError, match="--runtime 'tflite' is unknown; choose onnxruntime"):
        profile_device("fmnist-small", runtime="tflite")
    if "TensorrtExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has TensorRT")  # the refusal below is what a CPU-only onnxruntime says
    with pytest.raises(
        ProfileError, match="this onnxruntime has no TensorrtExecutionProvider .*install onnxruntime-gpu"
    ):
        profile_device("fmnist-small", "cpu", latency_target_ms=1e4, variants=2, repeats=1, provider="tensorrt")


def test_profile_device_rejects_bad_settings() -> None:
    with pytest.raises(ProfileError, match="at least 2 timed variants"):
        profile_device("fmnist-small", variants=1)
    with pytest.raises(ProfileError, match="--memory-fraction"):
        profile_device("fmnist-small", memory_fraction=0.0)
    with pytest.raises(DeviceError, match="'gpu' is not one of auto, cpu, cuda"):
        profile_device("fmnist-small", device="gpu")
    with pytest.raises(ProfileError, match="profile name"):
        profile_device("fmnist-small", variants=2, repeats=1, latency_target_ms=1e4, name="bad name")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_requested_without_a_cuda_device_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match="no CUDA device is available to PyTorch here; use --device auto or cpu"):
        read_hardware("cuda")
    with pytest.raises(DeviceError, match="no CUDA device"):
        profile_device("fmnist-small", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_profile_device_on_cuda(cache: VariantCache) -> None:
    profile = profile_device(
        "fmnist-small",
        "cuda",
        latency_target_ms=1e4,
        variants=3,
        repeats=5,
        name="test-cuda",
        runtime="torch",
        holdout=0,
    )
    assert profile.device == "cuda" and profile.hardware["cuda_name"]
    assert 0 < profile.memory_limit_bytes <= profile.hardware["cuda_memory_bytes"] // 2
    assert profile.latency_b_ms_per_mmac > 0 and profile.budget_macs in {e.macs for e in cache.entries}
    assert len(profile.measurements) == 3 and "cuda_name" in render(profile_table(profile))


# ------------------------------------------------------------------ serving precision (issue 22, item 2)
def _quantize_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every quantize_int8 call (the server's quantization) by the file it quantized."""
    from feast_edge.evaluate import quantize

    calls: list[str] = []
    real = quantize.quantize_int8

    def counted(fp32_path, *args, **kwargs):
        calls.append(str(fp32_path))
        return real(fp32_path, *args, **kwargs)

    monkeypatch.setattr(quantize, "quantize_int8", counted)
    return calls


def _timed_precisions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ``feast.precision`` of every ONNX file profiling opens a timing session on."""
    from feast_edge.agent import profiling
    from feast_edge.evaluate.onnx_export import read_metadata

    opened: list[str] = []
    real = profiling.ort_session

    def recorded(path, providers, threads):
        opened.append(read_metadata(path).get("precision", "fp32"))
        return real(path, providers, threads)

    monkeypatch.setattr(profiling, "ort_session", recorded)
    return opened


@pytest.mark.slow  # quantizes and times three variants
def test_profile_device_at_int8_times_the_quantized_files(monkeypatch: pytest.MonkeyPatch, cache: VariantCache) -> None:
    quantized, opened = _quantize_calls(monkeypatch), _timed_precisions(monkeypatch)
    noise_free(monkeypatch, {"int8": (0.4, 0.1)})  # two variants timed once on a quiet machine sloped down (CI)
    profile = profile_device(
        "fmnist-small", "cpu", latency_target_ms=1e4, variants=2, repeats=1, holdout=1, threads=1, precision="int8"
    )
    assert len(quantized) == 3 and opened == ["int8"] * 3  # every timed file is the int8 twin of an exported one
    assert profile.precision == "int8" and not profile.alternatives
    assert len(profile.measurements) == 2 and len(profile.holdout) == 1
    assert (profile.latency_a_ms, profile.latency_b_ms_per_mmac) == fit_latency(profile.measurements)
    assert "served in int8 (onnxruntime static quantization" in profile.source
    assert DeviceProfile.from_dict(profile.to_dict()) == profile and profile.to_dict()["precision"] == "int8"
    text = render(profile_table(profile))
    assert "int8 (onnxruntime static quantization" in text and f"{profile.budget_macs / 1e6:.2f}M MACs (int8)" in text


@pytest.mark.slow  # times two variants in both precisions
def test_profile_device_auto_times_both_precisions_and_keeps_the_larger_budget(
    monkeypatch: pytest.MonkeyPatch, fmnist: Preset, cache: VariantCache
) -> None:
    quantized, opened = _quantize_calls(monkeypatch), _timed_precisions(monkeypatch)
    noise_free(monkeypatch, {"fp32": (0.5, 0.2), "int8": (0.4, 0.1)})
    calls = []
    profile = profile_device(
        "fmnist-small",
        "cpu",
        latency_target_ms=1e4,
        variants=2,
        repeats=1,
        holdout=0,
        threads=1,
        precision="auto",
        progress=lambda d, n: calls.append((d, n)),
    )
    assert len(quantized) == 2 and sorted(opened) == ["fp32", "fp32", "int8", "int8"]
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]  # each variant timed in both precisions
    [(other, fit)] = profile.alternatives.items()
    assert {profile.precision, other} == {"fp32", "int8"}
    assert (fit.latency_a_ms, fit.latency_b_ms_per_mmac) == fit_latency(fit.measurements)
    assert fit.budget_macs == derive_budget(
        cache, fmnist, fit.latency_a_ms, fit.latency_b_ms_per_mmac, 1e4, profile.memory_limit_bytes
    )
    # The generous target affords the largest variant in both precisions: the tie keeps float32.
    assert profile.budget_macs == fit.budget_macs == cache.largest.macs and profile.precision == "fp32"
    assert DeviceProfile.from_dict(profile.to_dict()) == profile
    text = render(profile_table(profile))
    assert f"{profile.budget_macs / 1e6:.2f}M MACs (fp32)" in text and "in int8" in text and "not chosen" in text


def _fake_timers(monkeypatch: pytest.MonkeyPatch, lines: dict[str, tuple[float, float]]) -> None:
    """Profiling's timers replaced by exact lines ``a + b·MACs`` per precision (no ONNX files, no noise)."""
    from feast_edge.agent import profiling

    def timers(supernet, preset, chosen, shape, device, runtime, provider, threads, precisions, workdir):
        made = {
            p: [lambda n, w, m=entry.macs, ab=lines[p]: ab[0] + ab[1] * m / 1e6 for entry in chosen] for p in precisions
        }
        return made, "exact lines"

    monkeypatch.setattr(profiling, "_timers", timers)


@pytest.mark.parametrize(
    ("lines", "served"),
    [
        ({"fp32": (0.5, 0.2), "int8": (0.5, 0.1)}, "int8"),  # int8 twice as fast per MAC: a larger variant
        ({"fp32": (0.5, 0.1), "int8": (0.5, 0.2)}, "fp32"),  # int8 slower (no integer kernels): float32
        ({"fp32": (0.5, 0.1), "int8": (0.5, 0.1)}, "fp32"),  # a tie keeps float32
        ({"fp32": (100.0, 0.1), "int8": (0.5, 0.1)}, "int8"),  # float32 misses the target at every size
    ],
)
def test_auto_serves_the_precision_with_the_larger_budget(
    monkeypatch: pytest.MonkeyPatch, fmnist: Preset, cache: VariantCache, lines: dict, served: str
) -> None:
    _fake_timers(monkeypatch, lines)
    target = 0.5 + 0.1 * cache.entries[len(cache) // 2].macs / 1e6  # the middle variant at 0.1 ms/MMAC
    profile = profile_device("fmnist-small", "cpu", latency_target_ms=target, variants=3, repeats=1, precision="auto")
    budgets = {}
    for p, (a, b) in lines.items():
        try:
            budgets[p] = derive_budget(cache, fmnist, a, b, target, profile.memory_limit_bytes)
        except ProfileError:
            pass  # this precision affords no variant at all
    assert profile.precision == served and profile.budget_macs == budgets[served]
    assert {p: f.budget_macs for p, f in profile.alternatives.items()} == {
        p: v for p, v in budgets.items() if p != served
    }
    assert profile.latency_b_ms_per_mmac == pytest.approx(lines[served][1], rel=1e-9)


def test_auto_is_refused_only_when_neither_precision_affords_a_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_timers(monkeypatch, {"fp32": (100.0, 0.2), "int8": (50.0, 0.1)})
    # The reason given is int8's, whose lower estimate is the target to ask for.
    with pytest.raises(ProfileError, match="raise --latency-target-ms to at least 50.1"):
        profile_device("fmnist-small", "cpu", latency_target_ms=10.0, variants=2, repeats=1, precision="auto")


def test_a_precision_or_runtime_it_cannot_time_is_a_clear_error() -> None:
    with pytest.raises(ProfileError, match="--precision 'fp8' is unknown; choose fp32 .* int8 .* or auto"):
        profile_device("fmnist-small", precision="fp8")
    with pytest.raises(ProfileError, match="--precision int8 times onnxruntime's int8 files.*drop --runtime torch"):
        profile_device("fmnist-small", runtime="torch", precision="int8")


def test_the_profile_of_a_preset_file_names_the_variant_it_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A profile records the preset's name; the table finds the preset (and its cache beside it) from the file the
    user timed, as `feast-agent profile --preset FILE` passes it (issue 38: "largest affordable: unavailable")."""
    from strategies import FMNIST_TINY

    mine = tmp_path / "my-task.toml"
    mine.write_text(FMNIST_TINY.read_text().replace('name = "fmnist-tiny"', 'name = "my-task"'))
    cache = FMNIST_TINY.with_name("fmnist-tiny.cache.json").read_text()
    (tmp_path / "my-task.cache.json").write_text(cache.replace('"preset": "fmnist-tiny"', '"preset": "my-task"'))
    _fake_timers(monkeypatch, {"fp32": (0.5, 0.2)})
    profile = profile_device(str(mine), "cpu", latency_target_ms=1.0, variants=2, repeats=1, holdout=0)
    served = load_cache(load_preset(str(mine))).largest_affordable(profile.budget_macs)
    assert profile.preset == "my-task" and str(served.arch) in render(profile_table(profile, str(mine)))
    assert "unknown preset 'my-task'" in render(profile_table(profile))  # its name alone finds no preset
