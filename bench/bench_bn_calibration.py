"""Where a served variant's BN statistics come from, side by side: each device's own data vs federated statistics.

    PYTHONPATH=. python bench/bench_bn_calibration.py RUN_DIR [--test-samples 10000] [--calibration 200]

``RUN_DIR`` is a finished ``feast-edge demo --out RUN_DIR`` (any setting; the server without data): its
``devices/<device>/`` image folders and ``server/models/<device>.variant.safetensors``. For each device's
served variant (its trained weights, BN statistics replaced), on the Fashion-MNIST test split:

* ``own``: recalibrated on ``--calibration`` class-balanced examples of the device's own training split
  (``--bn-calibration device``);
* ``federated``: the moments of a seeded sample of each device that can run the variant, combined weighted by
  the devices' training examples (``--bn-calibration federated``, what the demo serves);
* ``federated, all devices``: the same with every device contributing, whatever its budget (what routing
  does not allow; shows what the affordability rule costs);
* ``pooled``: recalibrated on the union of those samples in one place (what a server holding the data would
  do; the reference the federated statistics estimate).

Prints one row per device and the ratio federated / own. The held-out split of each device is the agent's
(10 %, seeded), so the training splits match what the devices calibrated on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.table import Table
from safetensors.torch import load_file

from feast_edge.agent.local_data import load_clients
from feast_edge.cli.common import make_console
from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.bn_stats import apply_statistics, bn_statistics, combine_statistics
from feast_edge.evaluate.evaluation import correct_count
from feast_edge.evaluate.federated import calibrated_static, calibration_subset
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--data", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--test-samples", type=int, default=10_000)
    parser.add_argument("--calibration", type=int, default=200)
    args = parser.parse_args()
    preset = load_preset("fmnist-small")
    devices = sorted(p.name for p in (args.run / "devices").iterdir())
    data = {d: load_clients(args.run / "devices" / d, d, task=preset.task)[0] for d in devices}
    test = load_fashion_mnist(args.data, "test")
    images, labels = test.images[: args.test_samples], test.labels[: args.test_samples]
    manifests = {d: json.loads((args.run / "server/models" / f"{d}.json").read_text()) for d in devices}
    budgets = {d: manifests[d]["budget_macs"] for d in devices}
    samples = {d: calibration_subset(data[d].images, min(args.calibration, data[d].samples)) for d in devices}

    def accuracy(model: StaticResNet) -> float:
        return correct_count(model, images, labels, preset) / len(labels)

    table = Table(title=f"BN statistics of each served variant: test accuracy on {len(labels)} Fashion-MNIST images")
    for col in ("device", "MACs", "classes held", "own", "federated", "federated, all devices", "pooled", "fed / own"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for device in devices:
        m = manifests[device]
        arch = Arch.from_dict(m["arch"]).validated(preset)
        model = StaticResNet(arch_layout(preset, arch))
        model.load_state_dict(load_file(args.run / "server/models" / f"{device}.variant.safetensors"))
        calibrated_static(model, preset, data[device].images, args.calibration, labels=data[device].labels)
        own = accuracy(model)

        def federated(contributors: list[str]) -> float:
            reports = [(float(data[d].samples), bn_statistics(model, samples[d], preset)) for d in contributors]
            apply_statistics(model, combine_statistics(reports))
            return accuracy(model)

        able = [d for d in devices if budgets[d] >= m["macs"]]
        fed, fed_all = federated(able), federated(devices)
        pooled_images = torch.cat([samples[d] for d in able])
        calibrated_static(model, preset, pooled_images, len(pooled_images))
        pooled = accuracy(model)
        held = len(torch.unique(data[device].labels))
        table.add_row(
            device,
            f"{m['macs'] / 1e6:.2f}M",
            str(held),
            *(f"{100 * v:.2f}%" for v in (own, fed, fed_all, pooled)),
            f"{fed / own:.3f}",
        )
    make_console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
