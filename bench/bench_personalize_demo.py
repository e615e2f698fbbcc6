"""Every personalization method side by side on a finished demo's devices: own held-out and test accuracy, device time.

    PYTHONPATH=. python bench/bench_personalize_demo.py feast-demo [--test-limit 2000]

For each device of a finished ``feast-edge demo`` run directory (the server's ``server/models/DEVICE.variant.safetensors``
and the device's own image folder ``devices/DEVICE``), the served model is rebuilt as the agent rebuilt it
(``on_device.served_model``: its weights checked, BN statistics federated or its own) and every candidate the agent's
``auto`` tries is fitted on the same fit split (``select.fitted_candidates``). Each is counted on the selection split
(what ``auto`` chooses on), the device's own held-out split (what it reports; never used to choose) and the first
``--test-limit`` Fashion-MNIST test images (what the personal model forgets). Then ``auto``'s choice, as the agent made
it. Two tables: per device, and the fleet's mean and worst device per method.
"""

from __future__ import annotations

import json
import time

import torch
from _timing import demo_arguments, machine
from rich.table import Table

from feast_edge.agent.local_data import load_clients
from feast_edge.agent.on_device import served_model
from feast_edge.cli.common import make_console
from feast_edge.data.holdout import holdout_split
from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.evaluation import correct_count
from feast_edge.personalize.select import SELECTION_SEED, SELECTION_SHARE, Choice, fitted_candidates, personal_step
from feast_edge.space.preset import load_preset


def _pct(right: int, n: int) -> str:
    return f"{100 * right / n:.1f}%" if n else "-"


def main() -> None:
    parser = demo_arguments(__doc__)
    parser.add_argument("--test-limit", type=int, default=2000)
    args = parser.parse_args()
    console = make_console()
    console.print(machine())
    test = load_fashion_mnist(args.data, "test")
    test_images, test_labels = test.images[: args.test_limit], test.labels[: args.test_limit].long()
    rows: dict[str, dict[str, dict]] = {}
    for manifest_path in sorted((args.demo / "server" / "models").glob("*.json")):
        manifest = json.loads(manifest_path.read_text())
        if "device" not in manifest:
            continue  # index.json
        device = manifest["device"]
        preset = load_preset(manifest["preset"])
        data = load_clients(args.demo / "devices" / device, device, task=preset.task)[0]
        blob = (manifest_path.parent / manifest["file"]).read_bytes()
        served = served_model(blob, manifest, data, preset).model
        fit, select = holdout_split(data.labels, SELECTION_SHARE, SELECTION_SEED)

        def measure(model: torch.nn.Module, data=data, select=select, preset=preset) -> dict:
            return {
                "selection": correct_count(model, data.images[select], data.labels[select], preset),
                "own": correct_count(model, data.holdout_images, data.holdout_labels, preset),
                "test": correct_count(model, test_images, test_labels, preset),
            }

        sizes = {"selection": len(select), "own": data.holdout, "test": len(test_labels)}
        found = {"served": {**measure(served), "seconds": 0.0}}
        for method, strength, model, seconds in fitted_candidates(
            served, data.images[fit], data.labels[fit], preset, Choice.parse("auto")
        ):
            found[f"{method}:{strength:g}"] = {**measure(model), "seconds": seconds}
        began = time.perf_counter()
        outcome, own = personal_step(
            served, data.images, data.labels, data.holdout_images, data.holdout_labels, preset, Choice.parse("auto")
        )
        chosen = served if outcome.model is None else outcome.model
        found["auto"] = {**measure(chosen), "seconds": time.perf_counter() - began, "chose": outcome.reason}
        rows[device] = {"sizes": sizes, **found}
        table = Table(
            title=f"{device}: {data.samples} training examples, {data.holdout} held out, {manifest['macs'] / 1e6:.2f}M MACs"
        )
        for col in (
            "candidate",
            f"selection ({len(select)})",
            f"own held-out ({data.holdout})",
            f"test ({len(test_labels)})",
            "device s",
        ):
            table.add_column(col, justify="left" if col == "candidate" else "right")
        for name, r in found.items():
            table.add_row(
                name,
                _pct(r["selection"], len(select)),
                _pct(r["own"], data.holdout),
                _pct(r["test"], len(test_labels)),
                f"{r['seconds']:.2f}",
            )
        console.print(table)
        console.print(f"  auto: {outcome.reason}")
    names = [n for n in next(iter(rows.values())) if n != "sizes"]
    summary = Table(
        title=f"{len(rows)} devices of {args.demo}: own held-out accuracy (mean, worst device) and test accuracy (mean)"
    )
    for col in ("candidate", "own mean", "own worst", "worst device", "test mean", "device s (sum)"):
        summary.add_column(col, justify="left" if col in ("candidate", "worst device") else "right")
    for name in names:
        own = {d: r[name]["own"] / r["sizes"]["own"] for d, r in rows.items() if r["sizes"]["own"]}
        worst = min(own, key=own.get)
        test_mean = sum(r[name]["test"] / r["sizes"]["test"] for r in rows.values()) / len(rows)
        summary.add_row(
            name,
            f"{100 * sum(own.values()) / len(own):.1f}%",
            f"{100 * own[worst]:.1f}%",
            worst,
            f"{100 * test_mean:.1f}%",
            f"{sum(r[name]['seconds'] for r in rows.values()):.1f}",
        )
    console.print(summary)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
