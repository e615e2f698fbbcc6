"""Which base a personal model should start from: the served variant, or the largest variant the device can afford.

The serving rule (feast_edge.evaluate.coverage) may serve a device a smaller variant than its budget allows, when
that one is better on the *federation's* validation. On the device's own images the larger one can be better. For
each device of a finished ``feast-edge demo`` run served below its budget, this rebuilds both as the agent would
(the served file as ``on_device.served_model`` does; the largest affordable variant extracted from the checkpoint the
export used, BN recalibrated on the device's training split) and runs the agent's ``auto`` step on each:

    PYTHONPATH=. python bench/bench_personalize_bases.py feast-demo [--json bases.json]

Columns: each base's accuracy on the device's selection split (carved from its training split, which the federation
trained on: in-sample for both bases) and on its own held-out split (never trained on), before and after ``auto``.
"""

from __future__ import annotations

import json
import time

from _timing import demo_arguments, machine
from rich.table import Table

from feast_edge.agent.local_data import load_clients
from feast_edge.agent.on_device import served_model
from feast_edge.cache.variants import load_cache
from feast_edge.cli.common import make_console
from feast_edge.data.holdout import holdout_split
from feast_edge.evaluate.evaluation import correct_count
from feast_edge.evaluate.federated import CALIBRATION, calibrated_static
from feast_edge.personalize.select import SELECTION_SEED, SELECTION_SHARE, Choice, personal_step
from feast_edge.run.checkpoint import load_supernet
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset


def _pct(right: int, n: int) -> str:
    return f"{100 * right / n:.1f}% ({right}/{n})" if n else "-"


def main() -> None:
    parser = demo_arguments(__doc__)
    args = parser.parse_args()
    console = make_console()
    console.print(machine())
    table = Table(title=f"{args.demo}: personal model from the served variant vs the largest affordable one")
    for col in ("device", "base", "MACs", "selection", "own, base", "own, auto", "auto chose", "device s"):
        table.add_column(col, justify="left" if col in ("device", "base", "auto chose") else "right")
    rows = []
    for path in sorted((args.demo / "server" / "models").glob("*.json")):
        manifest = json.loads(path.read_text())
        if "device" not in manifest:
            continue  # index.json
        preset = load_preset(manifest["preset"])
        largest = load_cache(preset).largest_affordable(manifest["budget_macs"])
        if largest.macs == manifest["macs"]:
            continue  # served its largest affordable variant: one base only
        device = manifest["device"]
        data = load_clients(args.demo / "devices" / device, device, task=preset.task)[0]
        bases = {"served": served_model((path.parent / manifest["file"]).read_bytes(), manifest, data, preset).model}
        supernet = load_supernet(args.demo / "server" / manifest["checkpoint"], preset)[0]
        bases["largest"] = extract(supernet, largest.arch)
        calibrated_static(bases["largest"], preset, data.images, CALIBRATION, labels=data.labels)
        select = holdout_split(data.labels, SELECTION_SHARE, SELECTION_SEED)[1]
        for name, model in bases.items():
            began = time.perf_counter()
            outcome, own = personal_step(
                model, data.images, data.labels, data.holdout_images, data.holdout_labels, preset, Choice("auto")
            )
            row = {
                "device": device,
                "base": name,
                "macs": manifest["macs"] if name == "served" else largest.macs,
                "selection": correct_count(model, data.images[select], data.labels[select], preset),
                "selection_examples": len(select),
                "own_base": own.served,
                "own_auto": own.personal,
                "own_examples": own.examples,
                "chose": outcome.method or "kept",
                "seconds": time.perf_counter() - began,
            }
            rows.append(row)
            table.add_row(
                device,
                name,
                f"{row['macs'] / 1e6:.2f}M",
                _pct(row["selection"], len(select)),
                _pct(own.served, own.examples),
                _pct(own.personal, own.examples),
                f"{row['chose']} {outcome.strength:g}" if outcome.strength is not None else row["chose"],
                f"{row['seconds']:.1f}",
            )
    console.print(table)
    if not rows:
        console.print("every device was served its largest affordable variant: nothing to compare")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
