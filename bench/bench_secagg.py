"""Secure aggregation per routed segment: what it costs per device and on the server, and what it costs in accuracy.

    PYTHONPATH=. python bench/bench_secagg.py [--cost 10,50,100] [--accuracy] [--rounds 30] [--jobs 2]
                                               [--work DIR [--reuse]]

Cost (in this process, one thread): a cohort of N clients with Zipf budgets over the fmnist-small cache (method §4:
1.5M-100M MACs, seed 0), each routed its FEAST slice; each client's change is a small random step. Per budget
quartile: the masked upload in 32-bit values (one weight per masked segment included) against the plain sparse
upload of the same tensors in float32 (same bytes per value) and in float16; the sealed key shares each client
sends (key material, reported apart); the server's and the devices' time for one round's secure sums (all four
stages, every device in process) against the plain sums of the same updates; each with every pair of a segment's
members masking (``--secagg-neighbours`` N - 1) and with SecAgg+'s neighbour graph (``--secagg-neighbours 0``:
k = 2⌈log2 N⌉, at least 8; every pair up to 16 clients), side by side.

Accuracy (``--accuracy``, ``feast-edge simulate`` subprocesses, one thread each): one Zipf fleet (20 clients, 5 per
round, ``--rounds`` rounds, 4,000 training images), plain sums against secure sums with c = 0 (a segment revealed
over at least 2 clients) and c = 1 (3, the default): the final validation accuracy, the test accuracy of the served
variants per budget quartile (the top quartile alone trains the top slices, often one client a round), and the
withheld segments per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async import cpu, say, simulate, tiers  # noqa: E402

from feast_edge.aggregate.segments import plain_sums  # noqa: E402
from feast_edge.cache.variants import load_cache  # noqa: E402
from feast_edge.route.envelope import route_state  # noqa: E402
from feast_edge.route.plans import plan_client  # noqa: E402
from feast_edge.secagg.protocol import degree_for  # noqa: E402
from feast_edge.secagg.sums import plain_values, secure_sums  # noqa: E402
from feast_edge.sim.population import zipf_budgets  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402

QUARTILES = 4


def cost(n: int) -> None:
    """One round of ``n`` clients: uploads per budget quartile, key material, the round's time (see the docstring)."""
    preset = load_preset("fmnist-small")
    cache = load_cache(preset)
    budgets = zipf_budgets(n, np.random.default_rng(0), b_min=1.5e6, b_max=100e6)
    model = Supernet(preset, seed=0)
    global_state = model.state_dict()
    generator = torch.Generator().manual_seed(0)
    updates = []
    for i, budget in enumerate(budgets):
        layout = plan_client(cache, float(budget)).layout(preset, preset.classes)
        routed = route_state(global_state, layout, preset)
        for tensor in routed.values():
            if tensor.is_floating_point():
                tensor.add_(0.01 * torch.randn(tensor.shape, generator=generator))
        updates.append((f"c{i:03d}", routed, 100.0 + i))
    began = time.perf_counter()
    plain_sums(global_state, updates)
    plain_seconds = time.perf_counter() - began
    auto = degree_for(n)
    graphs = {"every pair": n - 1, f"SecAgg+ graph, k = {auto}" if auto else "default (every pair up to 16)": 0}
    held = 4 * sum(t.numel() for _, s, _ in updates for t in s.values() if t.is_floating_point()) / 2**20
    print(f"\n{n} clients: the server holds the round's updates, {held:.0f} MiB in float32 (plain) or as masked "
          "32-bit values (secure), beside the global model")  # fmt: skip
    for name, neighbours in graphs.items():
        began = time.perf_counter()
        done = secure_sums(global_state, updates, colluders=1, neighbours=neighbours)
        secure_seconds = time.perf_counter() - began
        print(f"\n{n} clients, {name}: one round's secure sums {secure_seconds:.1f} s (the server's part "
              f"{done.seconds['server']:.2f} s, the devices' {done.seconds['devices'] / n:.2f} s each on average) "
              f"against plain sums {plain_seconds:.2f} s; {len(done.withheld)} segments withheld; key material "
              f"(sealed shares) sent per client {statistics.mean(done.share_bytes.values()) / 1024:.1f} KiB")  # fmt: skip
    # The server's memory, traced in a run of its own (tracing slows the server's part several times): the default
    # graph's; every pair allocates the same arrays (one segment's sum and one mask at a time), only more often.
    traced = secure_sums(global_state, updates, colluders=1, trace_memory=True)
    print(f"the server's unmasking and release allocated at most {traced.server_peak / 2**20:.1f} MiB beyond the "
          "masked uploads it held")  # fmt: skip
    plain = plain_values(updates)
    order = sorted(range(n), key=lambda i: budgets[i])
    print(
        "| budget quartile | clients | plain upload (fp32 values) | masked upload | / fp32 | / fp16 | withheld values |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for q in range(QUARTILES):
        group = [f"c{i:03d}" for i in order[q * n // QUARTILES : (q + 1) * n // QUARTILES]]
        p = statistics.mean(plain[c] for c in group)
        m = statistics.mean(done.upload_values.get(c, 0) for c in group)
        print(f"| {q + 1} | {len(group)} | {p:,.0f} | {m:,.0f} | {m / p:.3f} | {2 * m / p:.3f} | "
              f"{statistics.mean(max(0, plain[c] - done.upload_values.get(c, 0)) for c in group):,.0f} |")  # fmt: skip


def accuracy(args: argparse.Namespace) -> None:
    work = args.work or Path("bench-secagg-work")
    base = [
        "--preset", "fmnist-small", "--clients", "20", "--per-round", "5", "--rounds", str(args.rounds),
        "--train-limit", "4000", "--test-limit", "2000", "--val-samples", "1000", "--calib-samples", "200",
        "--eval-every", "5", "--seed", "0",
    ]  # fmt: skip
    runs = {
        "plain": base,
        "secure c=0": [*base, "--secure-agg", "--colluders", "0"],
        "secure c=1": [*base, "--secure-agg"],
    }
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            name: pool.submit(simulate, name, options, work / name.replace(" ", "-").replace("=", ""), args.reuse)
            for name, options in runs.items()
        }
        results = {name: f.result() for name, f in futures.items()}
    print(
        "\n| run | final validation | test, all clients | test per budget quartile (low → high) | withheld segments per round |"
    )
    print("|---|---:|---:|---|---:|")
    for name, r in results.items():
        by_tier, _ = tiers(r)
        final = next(x["val_accuracy"] for x in reversed(r["rounds"]) if x["val_accuracy"] is not None)
        withheld = statistics.mean(len(x.get("withheld") or {}) for x in r["rounds"])
        print(f"| {name} | {100 * final:.2f} % | {100 * r['population_accuracy']:.2f} % | "
              + " / ".join(f"{100 * a:.1f}" for a in by_tier) + f" | {withheld:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost", default="10,50,100", help="cohort sizes of the cost part ('' to skip it)")
    parser.add_argument("--accuracy", action="store_true", help="also run the accuracy part (simulations)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    say(f"CPU: {cpu()}; torch {torch.__version__}, one thread")
    for n in [int(x) for x in args.cost.split(",") if x]:
        cost(n)
    if args.accuracy:
        accuracy(args)


if __name__ == "__main__":
    main()
