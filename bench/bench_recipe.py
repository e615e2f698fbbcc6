"""Training recipes side by side: the same short FEAST simulation under each candidate recipe.

    python bench/bench_recipe.py [--rounds 8] [--clients 10] [--per-round 5] [--train-limit 5000] [--preset fmnist-small]

Every candidate runs on the same population, partition, cohorts and seed;
only the [train] recipe differs (augmentation policy, learning rate, local
epochs). Prints population accuracy, the largest and the smallest cached
variant's test accuracy, the wall time, and each candidate's ratio to the
first (method §7's recipe). The measurement behind fmnist-small's [train]
table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from feast_edge.sim.setup import SimulationConfig

# name -> recipe settings on top of method §7 (randaugment+mix, lr 0.025, batch 64, 1 local epoch)
from feast_edge.sim.simulate import Simulation

# name -> recipe settings on top of method §7 (randaugment+mix, lr 0.025, batch 64, 1 local epoch)
CANDIDATES = {
    "spec7 (randaugment+mix, lr 0.025)": {"augment": "randaugment+mix", "lr": 0.025},
    "crop-flip, lr 0.025": {"augment": "crop-flip", "lr": 0.025},
    "crop-flip, lr 0.05": {"augment": "crop-flip", "lr": 0.05},
    "crop-flip+mix, lr 0.05": {"augment": "crop-flip+mix", "lr": 0.05},
    "crop-flip, lr 0.05, 2 epochs": {"augment": "crop-flip", "lr": 0.05, "epochs": 2},
    "none, lr 0.05": {"augment": "none", "lr": 0.05},
    "crop-flip, lr 0.1": {"augment": "crop-flip", "lr": 0.1},
    "crop-flip, lr 0.1, 2 epochs": {"augment": "crop-flip", "lr": 0.1, "epochs": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--train-limit", type=int, default=5000)
    parser.add_argument("--test-limit", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated candidate indices (0-based) to run")
    args = parser.parse_args()
    chosen = list(CANDIDATES.items())
    if args.only:
        chosen = [chosen[int(i)] for i in args.only.split(",")]
    rows = []
    for name, recipe in chosen:
        config = SimulationConfig.of(
            preset=args.preset,
            clients=args.clients,
            per_round=args.per_round,
            rounds=args.rounds,
            train_limit=args.train_limit,
            test_limit=args.test_limit,
            val_samples=1000,
            calib_samples=500,
            eval_every=args.rounds,
            seed=args.seed,
            **recipe,
        )
        began = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            results = Simulation(config, out).run()
        seconds = time.perf_counter() - began
        accs = [v["test_accuracy"] for v in results["variants"]]
        rows.append((name, results["population_accuracy"], accs[-1], accs[0], seconds))
        print(
            f"{name:34s} population {100 * rows[-1][1]:5.1f} %  largest {100 * accs[-1]:5.1f} %  smallest {100 * accs[0]:5.1f} %  {seconds:6.0f} s",
            flush=True,
        )
    base = rows[0][1]
    print(
        f"\n{args.preset}: {args.clients} clients, {args.per_round}/round, {args.rounds} rounds, train-limit {args.train_limit}, seed {args.seed}"
    )
    print(f"{'recipe':34s} {'population':>10s} {'largest':>8s} {'smallest':>9s} {'seconds':>8s} {'pop. ratio':>10s}")
    for name, pop, large, small, seconds in rows:
        print(f"{name:34s} {100 * pop:9.1f}% {100 * large:7.1f}% {100 * small:8.1f}% {seconds:8.0f} {pop / base:10.2f}")


if __name__ == "__main__":
    main()
