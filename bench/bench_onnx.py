"""onnxruntime vs PyTorch latency of one exported variant (CPU).

    python bench/bench_onnx.py [--preset fmnist-small] [--arch cached|full|JSON] [--repeats 30]

Prints median latency at batch 1 and batch 64 for both runtimes and the ratio
onnxruntime / PyTorch (below 1 means onnxruntime is faster).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved  # noqa: E402

from feast_edge.cache.variants import load_cache  # noqa: E402
from feast_edge.evaluate.onnx_export import INPUT_NAME, export_onnx, onnx_session  # noqa: E402
from feast_edge.space.arch import Arch  # noqa: E402
from feast_edge.space.cost import arch_cost  # noqa: E402
from feast_edge.space.extract import extract  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402
from feast_edge.space.static import Normalized  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument(
        "--arch",
        default="cached",
        help="'cached' (largest cached variant), 'full' (whole supernet) or an arch in JSON/text form",
    )
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    preset = load_preset(args.preset)
    if args.arch == "cached":
        arch = load_cache(preset).largest.arch
    elif args.arch == "full":
        arch = Arch.largest(preset)
    else:
        arch = Arch.parse(args.arch).validated(preset)
    model = extract(Supernet(preset), arch)
    torch_model = Normalized(model, preset.mean, preset.std).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "variant.onnx"
        export_onnx(model, path, preset, arch)
        session = onnx_session(path)
        macs, params = arch_cost(preset, arch)
        print(f"preset {preset.name}, arch {arch} ({macs / 1e6:.2f}M MACs, {params / 1e6:.2f}M params)")
        print(f"torch {torch.__version__} ({torch.get_num_threads()} threads); onnxruntime default CPU session")
        print(f"{'batch':>5} {'torch ms':>9} {'ort ms':>8} {'ort/torch':>9}")
        for batch in (1, 64):
            pixels = torch.rand(batch, preset.in_channels, preset.input_size, preset.input_size)
            feed = {INPUT_NAME: pixels.numpy().astype(np.float32)}
            with torch.inference_mode():
                t = interleaved(
                    {"torch": lambda: torch_model(pixels), "ort": lambda: session.run(None, feed)}, repeats=args.repeats
                )
            print(f"{batch:>5} {t['torch'] * 1e3:>9.2f} {t['ort'] * 1e3:>8.2f} {t['ort'] / t['torch']:>9.3f}")


if __name__ == "__main__":
    main()
