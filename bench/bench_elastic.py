"""Elastic supernet forward vs the extracted static model of the same arch (CPU, eval mode).

    python bench/bench_elastic.py [--preset fmnist-small] [--batch 64] [--repeats 20]

Prints, per arch, both median latencies and the ratio elastic / static (target <= 1.25).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved  # noqa: E402

from feast_edge.cache.variants import load_cache  # noqa: E402
from feast_edge.space.arch import Arch  # noqa: E402
from feast_edge.space.cost import arch_cost  # noqa: E402
from feast_edge.space.extract import extract  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402


def bench_archs(preset):
    n = preset.num_stages
    mid_e = preset.expansion_ratios[len(preset.expansion_ratios) // 2]
    return {
        "smallest": Arch.smallest(preset),
        "middle": Arch((1,) * n, (mid_e,) * n, (4,) * (n + 1)),
        "largest cached": load_cache(preset).largest.arch,
        "largest (full)": Arch.largest(preset),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    preset = load_preset(args.preset)
    supernet = Supernet(preset).eval()
    x = torch.randn(args.batch, preset.in_channels, preset.input_size, preset.input_size)
    print(f"preset {preset.name}, batch {args.batch}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'arch':<18} {'MACs':>9} {'elastic ms':>11} {'static ms':>10} {'ratio':>6}")
    for label, arch in bench_archs(preset).items():
        static = extract(supernet, arch)
        with torch.inference_mode():
            t = interleaved({"elastic": lambda: supernet(x, arch), "static": lambda: static(x)}, repeats=args.repeats)
        macs, _ = arch_cost(preset, arch)
        print(
            f"{label:<18} {macs / 1e6:>8.2f}M {t['elastic'] * 1e3:>11.2f} {t['static'] * 1e3:>10.2f} {t['elastic'] / t['static']:>6.3f}"
        )


if __name__ == "__main__":
    main()
