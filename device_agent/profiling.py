"""Measuring a device: read its hardware, time cached variants at batch 1, and build its profile.

The profile record, the latency fit, the memory model and the budget derived
from them are the method's (``feast_edge.budget.profile``); this module is the part
that needs the device itself.

Variants are timed on the runtime that will serve them: each is exported to
ONNX on the fly and run in onnxruntime with the device's execution provider
(CPU; CUDA or TensorRT where onnxruntime has them), as the exported model will
run. PyTorch eager is timed only when asked for (``runtime="torch"``). A few
variants the fit does not see are timed as well: the fit's error on them is
recorded in the profile.

A device served int8 files is timed on int8 files: each exported variant goes
through the quantization the server applies (``feast_edge.evaluate.quantize``),
calibrated here on random pixels, since only the timing matters. ``precision``
"auto" times float32 and int8 side by side and keeps the one with the larger
budget.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch import nn

from feast_edge.budget.derive import evaluation_limit, parse_macs
from feast_edge.budget.profile import (
    DEFAULT_LATENCY_TARGET_MS,
    NAME_PATTERN,
    Alternative,
    DeviceProfile,
    ProfileError,
    derive_budget,
    fit_latency,
)
from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.errors import FeastError
from feast_edge.evaluate.precisions import PRECISIONS
from feast_edge.local.torch_device import resolve_device
from feast_edge.space.extract import extract
from feast_edge.space.preset import Preset, load_preset
from feast_edge.space.supernet import Supernet

WARMUP = 3  # untimed forward passes before timing each variant
TIMING_ROUNDS = 5  # profile_device splits --repeats into this many interleaved rounds
RUNTIMES = ("onnxruntime", "torch")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
PROFILE_PRECISIONS = (*PRECISIONS, "auto")  # --precision: auto times each and keeps the larger budget
PRECISION_WORDS = {"fp32": "float32", "int8": "int8 (onnxruntime static quantization of each exported variant)"}
INT8_IMAGES = 64  # random images that calibrate a timed int8 file, and as many that (trivially) check it


def check_profile_precision(precision: str, runtime: str = "onnxruntime") -> None:
    """A ProfileError unless ``precision`` is one of PROFILE_PRECISIONS and ``runtime`` can time it."""
    if precision not in PROFILE_PRECISIONS:
        raise ProfileError(
            f"--precision {precision!r} is unknown; choose fp32 (float32), int8 (onnxruntime static quantization) "
            "or auto (time both, keep the larger budget)"
        )
    if precision != "fp32" and runtime != "onnxruntime":
        raise ProfileError(
            f"--precision {precision} times onnxruntime's int8 files, which PyTorch eager cannot run; "
            "drop --runtime torch (or profile with --precision fp32)"
        )


def _check_device(device: str) -> None:
    resolve_device(device)  # raises a DeviceError that says what to use instead


def _cpu_name() -> str:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name or platform.machine()


def read_hardware(device: str) -> dict[str, Any]:
    """What this machine reports: CPU cores and RAM (psutil), platform, torch, and the CUDA device when ``device == "cuda"``."""
    _check_device(device)
    memory = psutil.virtual_memory()
    hardware: dict[str, Any] = {
        "cores": psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,
        "logical_cores": psutil.cpu_count() or 1,
        "cpu": _cpu_name(),
        "ram_bytes": int(memory.total),
        "available_ram_bytes": int(memory.available),
        "machine": platform.machine(),
        "system": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # Other work on the machine slows timings down; recorded so a measurement can be judged.
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        hardware.update(
            cuda_name=props.name,
            cuda_capability=f"{props.major}.{props.minor}",
            cuda_multiprocessors=props.multi_processor_count,
            cuda_memory_bytes=int(total),
            cuda_free_bytes=int(free),
        )
    return hardware


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def time_variant(model: nn.Module, input_shape: Sequence[int], device: str, repeats: int, warmup: int) -> float:
    """Median wall time in ms of one forward pass on ``device`` (``input_shape`` includes the batch, normally 1)."""
    _check_device(device)
    if repeats < 1 or warmup < 0:
        raise ProfileError(
            f"timing needs repeats >= 1 and warmup >= 0 (got repeats={repeats}, warmup={warmup}); raise --repeats"
        )
    model = model.eval().to(device)
    # Values do not change the timing of a dense convnet; seeded anyway, so a run is reproducible.
    x = torch.randn(tuple(input_shape), generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(warmup):
        model(x)
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        _synchronize(device)  # CUDA kernels run asynchronously: time until they finish
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ort_providers(device: str, provider: str | None = None) -> list[str]:
    """The onnxruntime execution providers to time with: ``provider`` (cpu, cuda, tensorrt; default by ``device``), then CPU."""
    import onnxruntime as ort

    provider = provider or ("cuda" if device.startswith("cuda") else "cpu")
    if provider not in PROVIDERS:
        raise ProfileError(f"--provider {provider!r} is unknown; choose one of {', '.join(PROVIDERS)}")
    name, available = PROVIDERS[provider], ort.get_available_providers()
    if name not in available:
        raise ProfileError(
            f"this onnxruntime has no {name} (it has {', '.join(available)}); install onnxruntime-gpu for CUDA/TensorRT, "
            "or profile with --provider cpu (or --runtime torch)"
        )
    return [name] if name == PROVIDERS["cpu"] else [name, PROVIDERS["cpu"]]


def ort_session(path: Any, providers: list[str], threads: int | None) -> Any:
    """An onnxruntime session of an exported variant on ``providers`` (``threads``: intra-op threads, None = onnxruntime's default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=providers)


def time_session(session: Any, input_shape: Sequence[int], repeats: int, warmup: int) -> float:
    """Median wall time in ms of one ``session.run`` on random pixels of ``input_shape`` (batch included)."""
    from feast_edge.evaluate.onnx_export import INPUT_NAME, OUTPUT_NAME

    x = np.random.default_rng(0).random(tuple(input_shape), dtype=np.float32)
    for _ in range(warmup):
        session.run([OUTPUT_NAME], {INPUT_NAME: x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(
            [OUTPUT_NAME], {INPUT_NAME: x}
        )  # synchronous: a GPU provider copies the result back before it returns
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def quantize_for_timing(
    fp32_path: Path, out: Path, input_shape: Sequence[int], seed: int = 0, threads: int | None = None
) -> Path:
    """The int8 twin of an exported variant, for timing only: calibrated on random pixels, never refused.

    The server's quantization (``quantize_int8``) makes the file, so what is timed has the graph that is served;
    its activation ranges come from seeded uniform noise, and its accuracy check (the float32 file's own predictions
    as labels, tolerance 1) always passes, since a timing does not depend on the ranges.
    """
    from feast_edge.evaluate.quantize import predictions, quantize_int8

    rng = np.random.default_rng(seed)
    calibration, check = (rng.random((INT8_IMAGES, *input_shape[1:]), dtype=np.float32) for _ in range(2))
    origin = "random uniform pixels (feast-agent profile: timing only)"
    labels = predictions(fp32_path, check, threads)
    quantize_int8(fp32_path, out, calibration, check, labels, origin=origin, tolerance=1.0, threads=threads)
    return out


def _spread(n: int, k: int) -> list[int]:
    """``k`` indices evenly spread over ``0..n-1`` (both ends included; one index: the middle)."""
    k = min(k, n)
    if k <= 1:
        return [(n - 1) // 2] if k == 1 else []
    return sorted({int(i * (n - 1) / (k - 1) + 0.5) for i in range(k)})  # round half up


def _memory_available(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    return int(psutil.virtual_memory().available)


EVALUATION_MEMORY_FRACTION = 0.5  # --evaluate-up-to auto: the share of the free memory one evaluation may take


def check_evaluate_up_to(setting: str) -> str:
    """``--evaluate-up-to`` as given, once checked: auto, serving or a MAC count (FeastError naming the fix)."""
    if setting not in ("auto", "serving"):
        try:
            parse_macs(setting)
        except FeastError:
            raise FeastError(f"--evaluate-up-to {setting!r}: write auto, serving or a MAC count such as 20M") from None
    return setting


def evaluation_macs(setting: str, cache: VariantCache, preset: Preset, device: str, budget: float) -> int:
    """The largest variant (MACs) this device offers to evaluate and calibrate for the federation, at least ``budget``:
    ``auto`` as large as EVALUATION_MEMORY_FRACTION of its free memory allows, ``serving`` its budget, or a MAC count."""
    if setting == "serving":
        return int(budget)
    if setting == "auto":
        limit = evaluation_limit(cache, preset, int(EVALUATION_MEMORY_FRACTION * _memory_available(device)))
    else:
        limit = int(parse_macs(setting))
    return max(int(budget), limit)


def profile_device(
    preset_name: str,
    device: str = "auto",
    latency_target_ms: float = DEFAULT_LATENCY_TARGET_MS,
    memory_fraction: float = 0.5,
    variants: int = 6,
    repeats: int = 20,
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    runtime: str = "onnxruntime",
    provider: str | None = None,
    holdout: int = 3,
    threads: int | None = None,
    cache_file: str | None = None,
    precision: str = "fp32",
) -> DeviceProfile:
    """Measure this device: time ``variants`` cached variants at batch 1, fit ``a + b·MACs``, derive the budget.

    The variants are spread evenly by rank over the preset's cache (smallest
    and largest included) and extracted from a freshly initialised supernet
    (weights do not change the timing); ``holdout`` more, spread over the rest
    of the cache, are timed alongside but kept out of the fit (the profile
    records them, and the fit's error on them). ``runtime`` "onnxruntime"
    exports each to ONNX and times it with the execution ``provider`` (default:
    CUDA on a ``cuda`` device, else CPU; ``threads`` intra-op threads, None =
    onnxruntime's default), "torch" times PyTorch eager. ``precision`` is the
    precision the device will be served in: "fp32", "int8" (each exported file
    quantized as the server does, :func:`quantize_for_timing`; onnxruntime
    only) or "auto" (both timed side by side, both fitted; the profile is the
    one with the larger budget, float32 on a tie, and keeps the other in
    ``alternatives``). ``repeats`` passes per variant are timed in interleaved
    rounds; a variant's latency is the median of its round medians. The memory
    limit is ``memory_fraction`` × the available RAM (``cpu``) or the free CUDA
    memory (``cuda``): it bounds training, whatever serves. ``progress(done,
    total)`` is called as each timing completes. ``cache_file``: the cache to
    time (None: the preset's default, ``feast_edge.cache.variants.default_cache_path``).
    """
    device = resolve_device(device)
    kind = "cuda" if device.startswith("cuda") else "cpu"  # the profile records the kind of device, not its index
    if variants < 2:
        raise ProfileError(f"--variants {variants}: fitting a + b·MACs needs at least 2 timed variants")
    if repeats < 1:
        raise ProfileError(f"--repeats {repeats} must be at least 1")
    if not 0 < memory_fraction <= 1:
        raise ProfileError(
            f"--memory-fraction {memory_fraction} must be in (0, 1]: the share of the device's free memory training may use"
        )
    if not latency_target_ms > 0:
        raise ProfileError(f"--latency-target-ms {latency_target_ms} must be > 0")
    if runtime not in RUNTIMES:
        raise ProfileError(
            f"--runtime {runtime!r} is unknown; choose onnxruntime (what serves the exported model) or torch (PyTorch eager)"
        )
    check_profile_precision(precision, runtime)
    if holdout < 0:
        raise ProfileError(f"--holdout {holdout} must be >= 0")
    host = socket.gethostname()
    profile_name = name if name is not None else f"{host}-{kind}"
    if not NAME_PATTERN.match(profile_name):
        raise ProfileError(f"profile name {profile_name!r} must be letters, digits, '.', '_' or '-'; pass --name")
    preset = load_preset(preset_name)
    cache = load_cache(preset, cache_file)  # None: beside the preset's own file, else the shipped one
    if len(cache) < 2:
        raise ProfileError(
            f"the variant cache of preset {preset.name} holds {len(cache)} variant; fitting a + b·MACs needs at least 2"
        )
    hardware = read_hardware(device)
    supernet = Supernet(preset, classes=cache.classes, seed=0)
    fitted = _spread(len(cache), variants)
    rest = [i for i in range(len(cache)) if i not in fitted]
    held = [rest[j] for j in _spread(len(rest), holdout)] if rest and holdout else []
    chosen = [cache.entries[i] for i in fitted + held]
    shape = (1, preset.in_channels, preset.input_size, preset.input_size)
    timed_in = PRECISIONS if precision == "auto" else (precision,)
    with tempfile.TemporaryDirectory(prefix="feast-profile-") as tmp:
        timers, runtime_text = _timers(
            supernet, preset, chosen, shape, device, runtime, provider, threads, timed_in, Path(tmp)
        )
        # Time in interleaved rounds (and each variant in every precision one after the other): a burst of other work
        # on the machine then slows every variant a little instead of one variant a lot, which would tilt a fitted line.
        rounds = min(TIMING_ROUNDS, repeats)
        per_round = math.ceil(repeats / rounds)
        medians: dict[str, list[list[float]]] = {p: [[] for _ in chosen] for p in timed_in}
        total = len(chosen) * len(timed_in)
        for r in range(rounds):
            for i in range(len(chosen)):
                for j, p in enumerate(timed_in):
                    medians[p][i].append(timers[p][i](per_round, WARMUP if r == 0 else 1))
                    if progress is not None and r == rounds - 1:
                        progress(i * len(timed_in) + j + 1, total)
    memory_limit = int(memory_fraction * _memory_available(device))
    fits, failed = {}, None
    for p in timed_in:
        timed = [(float(entry.macs), statistics.median(ms)) for entry, ms in zip(chosen, medians[p])]
        measurements, held_out = timed[: len(fitted)], timed[len(fitted) :]
        try:
            a, b = fit_latency(measurements)
            budget = derive_budget(cache, preset, a, b, latency_target_ms, memory_limit)
        except ProfileError as exc:
            failed = exc  # with auto, the other precision may still afford a variant (int8: a faster one)
            continue
        fits[p] = Alternative(a, b, budget, tuple(measurements), tuple(held_out))
    if not fits:
        assert failed is not None
        raise failed  # the last timed precision's reason: with auto that is int8, whose latency target is the lower
    served = max(fits, key=lambda p: fits[p].budget_macs)  # the first (float32) on a tie
    fit = fits[served]
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    where = hardware.get("cuda_name", hardware["cpu"]) if kind == "cuda" else hardware["cpu"]
    return DeviceProfile(
        name=profile_name,
        description=f"{where} ({kind}), measured",
        device=kind,
        hardware=hardware,
        preset=preset.name,
        latency_a_ms=fit.latency_a_ms,
        latency_b_ms_per_mmac=fit.latency_b_ms_per_mmac,
        latency_target_ms=float(latency_target_ms),
        memory_limit_bytes=memory_limit,
        budget_macs=fit.budget_macs,
        source=(
            f"measured on {host} {date} by feast-agent profiling: {len(fitted)} cached variants of {preset.name} fitted "
            f"({len(held)} more held out), median of {rounds} interleaved rounds x {per_round} batch-1 forward passes each "
            f"on {runtime_text}, served {_served_words(served, fits)}; memory limit = {memory_fraction:g} x "
            f"{'free CUDA memory' if kind == 'cuda' else 'available RAM'}"
        ),
        measurements=fit.measurements,
        runtime=runtime_text,
        holdout=fit.holdout,
        precision=served,
        alternatives={p: f for p, f in fits.items() if p != served},
    )


def _served_words(served: str, fits: dict[str, Alternative]) -> str:
    """``in int8 (...)``, and with --precision auto how it compared with the other precision."""
    text, budget = f"in {PRECISION_WORDS[served]}", fits[served].budget_macs
    for other, fit in fits.items():
        if other != served and fit.budget_macs == budget:
            text += (
                f", kept over {other} by --precision auto (both afford {budget / 1e6:.2f}M MACs: a tie keeps float32)"
            )
        elif other != served:
            text += (
                f", chosen over {other} by --precision auto (budget {budget / 1e6:.2f}M vs "
                f"{fit.budget_macs / 1e6:.2f}M MACs)"
            )
    return text


def _timers(
    supernet: Supernet,
    preset: Any,
    chosen: Sequence[Any],
    shape: tuple[int, ...],
    device: str,
    runtime: str,
    provider: str | None,
    threads: int | None,
    precisions: Sequence[str],
    workdir: Path,
) -> tuple[dict[str, list[Callable[[int, int], float]]], str]:
    """Per precision, one ``timer(repeats, warmup) -> median ms`` per chosen variant on ``runtime``; a line naming what runs them."""
    models = [extract(supernet, entry.arch) for entry in chosen]
    if runtime == "torch":  # float32 only (profile_device refuses int8 on torch)
        if threads is not None:
            torch.set_num_threads(threads)
        text = f"PyTorch {torch.__version__} eager on {device} ({torch.get_num_threads()} threads)"
        return {"fp32": [lambda n, w, m=model: time_variant(m, shape, device, n, w) for model in models]}, text
    import onnxruntime as ort

    from feast_edge.evaluate.onnx_export import export_onnx

    providers = ort_providers(device, provider)
    timers: dict[str, list[Callable[[int, int], float]]] = {p: [] for p in precisions}
    for i, (entry, model) in enumerate(zip(chosen, models)):
        files = {"fp32": workdir / f"variant-{i}.onnx"}
        export_onnx(model, files["fp32"], preset, entry.arch)  # the file a device is served, as the server exports it
        if "int8" in precisions:
            files["int8"] = quantize_for_timing(
                files["fp32"], workdir / f"variant-{i}-int8.onnx", shape, seed=i, threads=threads
            )
        for p in precisions:
            session = ort_session(files[p], providers, threads)
            timers[p].append(lambda n, w, s=session: time_session(s, shape, n, w))
    text = f"onnxruntime {ort.__version__}, {providers[0]}, {threads or 'default'} intra-op threads"
    return timers, text
