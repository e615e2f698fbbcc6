"""Plot simulate runs: test accuracy vs MACs per cached variant, and validation accuracy over rounds.

    python bench/plot_experiment.py --out docs/img/fmnist-experiment.png RUN_DIR[=LABEL] ...

Reads each run's results.json (written by `feast-edge simulate`). Needs matplotlib
(`pip install matplotlib`); it is not a runtime dependency of feast-edge.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories, optionally DIR=LABEL")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec in args.runs:
        directory, _, label = spec.partition("=")
        results = json.loads((Path(directory) / "results.json").read_text())
        label = label or results["config"]["variants"]
        macs = [v["macs"] / 1e6 for v in results["variants"]]
        accs = [100 * v["test_accuracy"] for v in results["variants"]]
        left.plot(
            macs,
            accs,
            marker="o",
            markersize=3,
            label=f"{label} (population {100 * results['population_accuracy']:.1f}%)",
        )
        rounds = [r["round"] + 1 for r in results["rounds"] if r["val_accuracy"] is not None]
        vals = [100 * r["val_accuracy"] for r in results["rounds"] if r["val_accuracy"] is not None]
        right.plot(rounds, vals, marker="o", markersize=3, label=label)
    left.set(
        xlabel="inference MACs per example (millions)",
        ylabel="test accuracy (%)",
        title="per-variant test accuracy (best checkpoint)",
    )
    right.set(xlabel="round", ylabel="validation accuracy (%)", title="mean validation accuracy of the probe variants")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
