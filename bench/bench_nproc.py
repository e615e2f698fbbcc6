"""Seconds per simulated round, one process vs the cohort spread over two (``feast-edge simulate --nproc 2``).

    PYTHONPATH=. python bench/bench_nproc.py [--clients 10] [--train-limit 3000] [--rounds 3]

fmnist-small on Fashion-MNIST, every client in every round. Three runs of the
same config advance side by side, one round each in turn: one process with
PyTorch's default threads (what ``--nproc 1`` gets), one process with one
thread, and two processes with one thread each (what ``--nproc 2`` gets on a
2-core machine). Prints the median round time of each, the ratios, and whether
the one-thread runs ended with identical weights (they must).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from feast_edge.cli.worker import COMMAND
from feast_edge.sim.distributed import Spread, assign
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.simulate import Simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = SimulationConfig.of(
        clients=args.clients,
        per_round=args.clients,
        rounds=args.rounds,
        train_limit=args.train_limit,
        val_samples=200,
        calib_samples=100,
    )
    default_threads = torch.get_num_threads()
    runs = {  # label -> (processes, threads per process)
        f"1 process, {default_threads} threads": (1, default_threads),
        "1 process, 1 thread": (1, 1),
        "2 processes, 1 thread each": (2, 1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        sims, spreads = {}, {}
        for i, (label, (nproc, threads)) in enumerate(runs.items()):
            if nproc > 1:
                spreads[label] = Spread(config, nproc=nproc, threads=threads, command=COMMAND)
            clients = spreads[label].clients if nproc > 1 else None
            sims[label] = Simulation(config, os.path.join(tmp, str(i)), clients=clients)
        s = next(iter(sims.values())).setup
        sizes = sorted(int(n) for n in s.population.sizes)
        print(
            f"fmnist-small, {args.clients} clients per round, shard sizes {sizes[0]}..{sizes[-1]} (total {sum(sizes)}), "
            f"{config.train_config().epochs} local epoch(s), torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
        )
        seconds: dict[str, list[float]] = {label: [] for label in runs}
        busy: list[list[float]] = []  # the two-process run: each process's summed client training seconds, per round
        try:
            for t in range(args.rounds):
                for label, (_, threads) in runs.items():
                    torch.set_num_threads(threads)
                    start = time.perf_counter()
                    record = sims[label].run_round(t)
                    seconds[label].append(time.perf_counter() - start)
                    if label in spreads:
                        sim = sims[label]
                        plans = sim.method.plans(t, record.cohort, sim.collector.budget)
                        costs = [
                            sim.method.train_cost(plans[c]) * int(s.population.sizes[s.client_ids.index(c)])
                            for c in record.cohort
                        ]
                        busy.append(
                            [sum(record.compute_seconds[c] for c in part) for part in assign(record.cohort, costs, 2)]
                        )
                print(
                    f"round {t + 1}: " + ", ".join(f"{label} {v[-1]:.2f} s" for label, v in seconds.items()), flush=True
                )
        finally:
            for spread in spreads.values():
                spread.close()
        base = statistics.median(next(iter(seconds.values())))
        print(f"\n{'run':<30} {'median s/round':>15} {'vs first row':>13}")
        for label, values in seconds.items():
            print(f"{label:<30} {statistics.median(values):>15.2f} {base / statistics.median(values):>12.2f}x")
        print(
            "two processes, training seconds per process and round: " + ", ".join(f"{x:.1f} + {y:.1f}" for x, y in busy)
        )
        a, b = (sims[label].model.state_dict() for label in ("1 process, 1 thread", "2 processes, 1 thread each"))
        same = all(torch.equal(a[k], b[k]) for k in a)
        print(
            f"weights after {args.rounds} rounds, 1 process vs 2 processes at 1 thread each: {'bit-identical' if same else 'DIFFERENT'}"
        )
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
