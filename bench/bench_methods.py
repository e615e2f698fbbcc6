"""Seconds per round of every harness method, side by side, on the CPU preset.

    python bench/bench_methods.py [--rounds 3] [--clients 10] [--per-round 5] [--train-limit 5000] [--methods feast,heterofl,...]

Every method runs the same rounds (same population, partition, cohorts,
recipe and seed) without validation, so a round is exactly: plans, each
cohort member's local training, aggregation. Prints the mean seconds per
round, the parameters sent per round (both directions), the training-compute
proxy per round, and each method's time ratio to FEAST.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from feast_edge.sim.methods import METHODS
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.simulate import Simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--train-limit", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    rows = []
    for method in args.methods.split(","):
        config = SimulationConfig.of(
            preset=args.preset,
            method=method,
            clients=args.clients,
            per_round=args.per_round,
            rounds=args.rounds,
            train_limit=args.train_limit,
            val_samples=500,
            calib_samples=200,
            eval_every=10**6,
            seed=args.seed,
        )
        with tempfile.TemporaryDirectory() as out:
            sim = Simulation(config, out)
            seconds, records = [], []
            for t in range(args.rounds):
                began = time.perf_counter()
                records.append(sim.run_round(t))
                seconds.append(time.perf_counter() - began)
        sent = 2 * statistics.mean(r.routed_params for r in records)
        compute = statistics.mean(r.train_macs for r in records)
        rows.append((method, statistics.mean(seconds), min(seconds), max(seconds), sent, compute))
        print(f"{method:12s} {rows[-1][1]:7.1f} s/round (min {rows[-1][2]:.1f}, max {rows[-1][3]:.1f})", flush=True)
    base = next((r[1] for r in rows if r[0] == "feast"), rows[0][1])
    print(
        f"\n{args.preset}: {args.clients} clients, {args.per_round}/round, {args.rounds} rounds, train-limit {args.train_limit}, "
        f"seed {args.seed}, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'method':12s} {'s/round':>8s} {'min':>6s} {'max':>6s} {'sent/round':>12s} {'TMAC/round':>11s} {'vs feast':>9s}"
    )
    for method, mean, low, high, sent, compute in rows:
        print(
            f"{method:12s} {mean:8.1f} {low:6.1f} {high:6.1f} {sent / 1e6:11.2f}M {compute / 1e12:11.3f} {mean / base:8.2f}x"
        )


if __name__ == "__main__":
    main()
