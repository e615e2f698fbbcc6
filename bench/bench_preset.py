"""Forward+backward time of a preset's largest cached variant (the figure the CPU preset is sized by).

    python bench/bench_preset.py [--preset fmnist-small] [--batch 64] [--repeats 10]

Times one training step's forward and backward (cross-entropy, no optimizer)
of the smallest, median and largest cached variants, as extracted static
models and through the elastic supernet, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved  # noqa: E402

from feast_edge.cache.variants import load_cache  # noqa: E402
from feast_edge.space.extract import extract  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    preset = load_preset(args.preset)
    cache = load_cache(preset)
    supernet = Supernet(preset).train()
    x = torch.randn(args.batch, preset.in_channels, preset.input_size, preset.input_size)
    y = torch.randint(0, preset.classes, (args.batch,))
    picks = {"smallest": cache.entries[0], "median": cache.entries[len(cache) // 2], "largest": cache.entries[-1]}
    print(f"preset {preset.name}, batch {args.batch}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'variant':<9} {'MACs':>8} {'static fwd+bwd s':>17} {'elastic fwd+bwd s':>18}")
    for label, entry in picks.items():
        static = extract(supernet, entry.arch).train()

        def static_step() -> None:
            static.zero_grad(set_to_none=True)
            F.cross_entropy(static(x), y).backward()

        def elastic_step() -> None:
            supernet.zero_grad(set_to_none=True)
            F.cross_entropy(supernet(x, entry.arch), y).backward()

        t = interleaved({"static": static_step, "elastic": elastic_step}, repeats=args.repeats, warmup=2)
        print(f"{label:<9} {entry.macs / 1e6:>7.2f}M {t['static']:>17.3f} {t['elastic']:>18.3f}")


if __name__ == "__main__":
    main()
