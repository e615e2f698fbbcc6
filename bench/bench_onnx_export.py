"""ONNX export of a served variant: the TorchScript exporter (what feast-edge uses) vs the torch.export-based one.

    python bench/bench_onnx_export.py [--preset fmnist-small] [--variants 3] [--repeats 3]

For the smallest, a middle and the largest cached variant of the preset it exports the same normalized, extracted
network with both exporters, alternating them (interleaved medians), checks that both files compute the same
logits in onnxruntime on random inputs at batch 1 and 7 (dynamic batch), and prints seconds per export and the
ratio torch.export / TorchScript (above 1: the TorchScript exporter is faster).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved  # noqa: E402

from feast_edge.cache.variants import load_cache  # noqa: E402
from feast_edge.evaluate.onnx_export import INPUT_NAME, export_dynamo, export_torchscript  # noqa: E402
from feast_edge.space.extract import extract  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402
from feast_edge.space.static import Normalized  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402


def _logits(blob: bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    return session.run(None, {INPUT_NAME: x})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--variants", type=int, default=3, help="cached variants, evenly spaced by MACs rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = load_preset(args.preset)
    cache = load_cache(preset)
    supernet = Supernet(preset, seed=0)
    n = len(cache.entries)
    picks = sorted({round(i * (n - 1) / max(args.variants - 1, 1)) for i in range(args.variants)})
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, {platform.processor() or platform.machine()}")
    print(f"{'variant':>10} {'TorchScript s':>14} {'torch.export s':>15} {'ratio':>7} {'max |diff|':>11}")
    rng = np.random.default_rng(0)
    for i in picks:
        entry = cache.entries[i]
        model = Normalized(extract(supernet, entry.arch), preset.mean, preset.std).eval()
        example = torch.rand(2, preset.in_channels, preset.input_size, preset.input_size)
        times = interleaved(
            {
                "torchscript": lambda: export_torchscript(model, example),
                "dynamo": lambda: export_dynamo(model, example),
            },
            repeats=args.repeats,
            warmup=1,
        )
        diff = 0.0
        for batch in (1, 7):
            x = rng.random((batch, preset.in_channels, preset.input_size, preset.input_size), dtype=np.float32)
            a, b = _logits(export_torchscript(model, example), x), _logits(export_dynamo(model, example), x)
            diff = max(diff, float(np.abs(a - b).max()))
        ratio = times["dynamo"] / times["torchscript"]
        print(
            f"{entry.macs / 1e6:>9.2f}M {times['torchscript']:>14.2f} {times['dynamo']:>15.2f} {ratio:>6.1f}x {diff:>11.2e}"
        )


if __name__ == "__main__":
    main()
