"""Half-precision payloads on paper-cifar100: bytes on the wire per budget and over a Zipf population, float32 vs float16/bfloat16.

For the paper's Table 9 budgets (25M, 50M, 229M, 408M, 596M MACs) each routed
envelope of the supernet is encoded as a real payload (safetensors + manifest,
``feast_edge.route.payload.encode``) in every payload dtype and decoded again; the
table gives the bytes, the ratio to the float32 payload and to a float32
broadcast of the full supernet, and the encode + decode time. The population
line does the same for the mean routed payload of a 100-client Zipf population
(``feast-edge routing``'s population).

    PYTHONPATH=. python bench/bench_payload_dtype.py [--reference-csv tests/data/reference/feast-cifar100-cache.csv]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from feast_edge.cache.build import read_reference_csv
from feast_edge.cache.variants import load_cache
from feast_edge.route.envelope import communication_report, route_state
from feast_edge.route.payload import PAYLOAD_DTYPES, bytes_per_param, decode, encode
from feast_edge.route.plans import plan_client
from feast_edge.sim.population import zipf_budgets
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

TABLE_9 = (25e6, 50e6, 229e6, 408e6, 596e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="paper-cifar100")
    parser.add_argument(
        "--reference-csv", type=Path, help="the paper's published cache CSV (default: the preset's shipped cache)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    preset = load_preset(args.preset)
    cache = read_reference_csv(args.reference_csv, preset) if args.reference_csv else load_cache(preset)
    state = Supernet(preset, seed=0).state_dict()
    full = sum(v.numel() for v in state.values() if v.is_floating_point())
    broadcast = full * 4
    print(
        f"{preset.name}: full supernet {full / 1e6:.2f}M floating values, float32 broadcast {broadcast / 1e6:.2f} MB per client"
    )
    print(
        f"{'budget':>8} {'params':>9} "
        + " ".join(f"{name + ' MB':>13} {'x f32':>6} {'x bcast':>8} {'ms':>6}" for name in PAYLOAD_DTYPES)
    )
    for budget in TABLE_9:
        plan = plan_client(cache, budget)
        routed = route_state(state, plan.layout(preset, preset.classes), preset)
        params = sum(v.numel() for v in routed.values() if v.is_floating_point())
        cells, base = [], None
        for name in PAYLOAD_DTYPES:
            manifest = plan.manifest(preset, preset.classes, 0, "routed", "bench", name)
            began = time.perf_counter()
            blob = encode(routed, manifest)
            decode(blob, preset, expected=manifest)
            ms = 1e3 * (time.perf_counter() - began)
            base = base or len(blob)
            cells.append(f"{len(blob) / 1e6:>13.2f} {base / len(blob):>6.2f} {broadcast / len(blob):>8.1f} {ms:>6.0f}")
        print(f"{budget / 1e6:>7.0f}M {params / 1e6:>8.2f}M " + " ".join(cells))
    archs = sorted((arch_cost(preset, e.arch, preset.classes)[0], e.arch) for e in cache.entries)
    population = zipf_budgets(100, np.random.default_rng(0), s=1.2, b_min=preset.budget_min, b_max=preset.budget_max)
    report = communication_report(preset, archs, population, preset.classes)
    print(f"\n100-client Zipf population (s=1.2, seed 0): mean routed payload {report.mean_payload / 1e6:.2f}M params")
    for name in PAYLOAD_DTYPES:
        mean_bytes = report.mean_payload * bytes_per_param(name)
        print(
            f"  {name:>8}: {mean_bytes / 1e6:7.2f} MB per client and direction; vs float32 routed x{report.mean_payload * 4 / mean_bytes:.2f}; "
            f"vs float32 broadcast x{report.full_params * 4 / mean_bytes:.2f}"
        )


if __name__ == "__main__":
    main()
