"""float32 vs int8 ONNX for every cached variant of a trained supernet: latency, accuracy, and the budgets they give.

    PYTHONPATH=. python bench/bench_int8.py --checkpoint RUN/checkpoint.safetensors \
        [--data /usr/share/datasets/fashion-mnist] [--test 2000] [--repeats 30] [--every 1]

Each variant is extracted, BN-recalibrated on 500 training images (as ``feast-server export`` does), exported in
float32 and quantized to int8 (``feast_edge.evaluate.quantize``: 256 training images calibrate, the tolerance is
opened so every variant is measured). Latency is the median of interleaved batch-1 and batch-32 runs with 1 and 2
onnxruntime threads, float32 and int8 alternating; accuracy is on the first ``--test`` images of the test split.

Then the budgets: this machine's a + b·MACs fit at batch 1, 1 thread, in each precision, and the largest cached
variant each affords at the latency target of every built-in profile. The built-in (documented) profiles cannot be
timed here: their int8 line is estimated from this machine's (marked): their a plus the extra overhead int8 has here,
their b times the slope ratio measured here. An estimate only: CPUs with VNNI or Arm's dot-product extension gain more.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved

from feast_edge.budget.profile import (
    ProfileError,
    available_profiles,
    derive_budget,
    fit_latency,
    load_profile,
)
from feast_edge.cache.variants import load_cache
from feast_edge.data.images import FASHION_MNIST_DIR, load_fashion_mnist, normalize
from feast_edge.evaluate.onnx_export import INPUT_NAME, OUTPUT_NAME, export_onnx, onnx_session
from feast_edge.evaluate.quantize import predictions, quantize_int8
from feast_edge.run.checkpoint import load_supernet
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import load_preset

SETTINGS = [(1, 1), (1, 2), (32, 1), (32, 2)]  # (batch, threads)


def _budget(cache, preset, a: float, b: float, profile) -> float | None:
    """derive_budget at the profile's latency target and memory limit; None when not even the smallest variant fits."""
    try:
        return derive_budget(cache, preset, a, b, profile.latency_target_ms, profile.memory_limit_bytes)
    except ProfileError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, help="a trained supernet (e.g. a demo's server/checkpoint.safetensors)"
    )
    parser.add_argument("--data", default=str(FASHION_MNIST_DIR))
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--every", type=int, default=1, help="time every k-th cached variant (the largest always)")
    parser.add_argument(
        "--budgets-from",
        type=float,
        nargs=4,
        metavar=("FP32_A", "FP32_B", "INT8_A", "INT8_B"),
        help="skip the timing: the budget table of fmnist-small from these fits (ms, ms/MMAC) of an earlier run",
    )
    args = parser.parse_args()
    if args.budgets_from:
        preset = load_preset("fmnist-small")
        fa, fb, qa, qb = args.budgets_from
        budgets(preset, load_cache(preset), (fa, fb), (qa, qb))
        return

    supernet, _ = load_supernet(args.checkpoint)
    preset = supernet.preset
    cache = load_cache(preset)
    train, test = load_fashion_mnist(args.data, "train"), load_fashion_mnist(args.data, "test")
    images = test.floats(slice(0, args.test)).numpy()
    labels = test.labels[: args.test].numpy()
    chosen = [e for i, e in enumerate(cache.entries) if i % args.every == 0 or i == len(cache) - 1]
    rows, fp32_points, int8_points = [], [], []
    print(f"{len(chosen)} variants of {preset.name}, {args.test} test images, {args.repeats} interleaved repeats")
    print(
        "| MACs | fp32 acc | int8 acc | same class | "
        + " | ".join(f"b{b} t{t} fp32 / int8 ms (x)" for b, t in SETTINGS)
        + " |"
    )
    print("|---:|---:|---:|---:|" + "---:|" * len(SETTINGS))
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
        for entry in chosen:
            model = extract(supernet, entry.arch)
            recalibrate_bn(model, normalize(train.floats(slice(0, 500)), preset.mean, preset.std).split(100))
            fp32, int8 = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
            export_onnx(model.eval(), fp32, preset, entry.arch)
            _, check = quantize_int8(fp32, int8, train.images[1000:1256], images, labels, origin="bench", tolerance=1.0)
            same = float((predictions(int8, images) == predictions(fp32, images)).mean())
            cells = []
            for batch, threads in SETTINGS:
                x = np.ascontiguousarray(images[:batch])
                sessions = {p: onnx_session(path, threads=threads) for p, path in (("fp32", fp32), ("int8", int8))}
                times = interleaved(
                    {p: (lambda s=s, x=x: s.run([OUTPUT_NAME], {INPUT_NAME: x})) for p, s in sessions.items()},
                    repeats=args.repeats,
                )
                f, q = 1e3 * times["fp32"], 1e3 * times["int8"]
                cells.append(f"{f:.3f} / {q:.3f} ({f / q:.2f}x)")
                if (batch, threads) == (1, 1):
                    fp32_points.append((float(entry.macs), f))
                    int8_points.append((float(entry.macs), q))
            rows.append((entry.macs, check.fp32_accuracy, check.int8_accuracy, same))
            print(
                f"| {entry.macs / 1e6:.2f}M | {100 * check.fp32_accuracy:.2f} % | {100 * check.int8_accuracy:.2f} % "
                f"| {100 * same:.2f} % | " + " | ".join(cells) + " |",
                flush=True,
            )
    budgets(preset, cache, fit_latency(fp32_points), fit_latency(int8_points))


def budgets(preset, cache, fp32: tuple[float, float], int8: tuple[float, float]) -> None:
    """The fits and, per built-in profile of ``preset``, the float32 and int8 budgets they give."""
    (fa, fb), (qa, qb) = fp32, int8
    print(
        f"\nthis machine, batch 1, 1 thread: fp32 {fa:.3f} ms + {fb:.4f} ms/MMAC; int8 {qa:.3f} ms + {qb:.4f} ms/MMAC"
    )
    print(f"int8/fp32: a x{qa / fa if fa else float('nan'):.2f}, b x{qb / fb:.2f}\n")
    print("| profile | latency target | fp32 budget | int8 budget | how int8 is known |")
    print("|---|---:|---:|---:|---|")
    for name in sorted(available_profiles()):
        profile = load_profile(name)
        if profile.preset != preset.name:
            continue
        target = profile.latency_target_ms
        if profile.measurements:  # a measured profile: this machine's own lines
            fp32_budget, int8_budget = _budget(cache, preset, fa, fb, profile), _budget(cache, preset, qa, qb, profile)
            how = "timed here (the fits above)"
        else:
            a, b = profile.latency_a_ms, profile.latency_b_ms_per_mmac
            fp32_budget = _budget(cache, preset, a, b, profile)
            # A documented a is mostly the framework's per-inference overhead: int8 adds this machine's extra
            # overhead (its quantize/dequantize steps) to it, and scales the per-MAC slope by this machine's ratio.
            int8_budget = _budget(cache, preset, a + max(qa - fa, 0.0), b * qb / fb, profile)
            how = f"estimated: a + {max(qa - fa, 0.0):.3f} ms, b x {qb / fb:.2f} (this machine's int8 vs fp32)"
        show = lambda m: "-" if m is None else f"{m / 1e6:.2f}M"
        print(f"| {name} | {target:g} ms | {show(fp32_budget)} | {show(int8_budget)} | {how} |")


if __name__ == "__main__":
    main()
