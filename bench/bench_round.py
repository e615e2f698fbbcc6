"""Seconds per FEAST round for a 10-client cohort on the CPU preset (simulation path).

    python bench/bench_round.py [--clients 10] [--train-limit 20000] [--rounds 2]

Builds a population of N clients (all sampled every round), runs a few rounds
through the same route -> co-train -> aggregate functions the federation uses,
and prints the wall time of each phase per round.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.local.recipe import cosine_lr
from feast_edge.local.update import client_update
from feast_edge.route.envelope import route_state
from feast_edge.run.cohort import client_seed, sample_round_cohort
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.simulate import Simulation
from feast_edge.space.cost import count_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = SimulationConfig.of(
        clients=args.clients,
        per_round=args.clients,
        rounds=args.rounds,
        train_limit=args.train_limit,
        val_samples=500,
        calib_samples=100,
    )
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(config, tmp)
        s = sim.setup
        print(
            f"fmnist-small, {args.clients} clients per round, {args.train_limit} client examples, torch {torch.__version__} ({torch.get_num_threads()} threads)"
        )
        print(f"{'round':>5} {'samples':>8} {'route s':>8} {'train s':>8} {'aggregate s':>12} {'total s':>8}")
        for t in range(args.rounds):
            cohort = sample_round_cohort(s.client_ids, config.population.per_round, config.seed, t)
            lr = cosine_lr(config.training.lr, t, config.training.rounds)
            global_state = sim.model.state_dict()
            t_route = t_train = 0.0
            updates, samples = [], 0
            for cid in cohort:
                start = time.perf_counter()
                plan = s.plans[cid]
                state = route_state(global_state, plan.layout(sim.preset, sim.classes), sim.preset)
                t_route += time.perf_counter() - start
                images, labels = s.client_data(cid)
                start = time.perf_counter()
                new_state, result = client_update(
                    sim.preset,
                    sim.classes,
                    plan,
                    state,
                    images,
                    labels,
                    config.train_config(),
                    lr,
                    client_seed(config.seed, t, cid),
                )
                t_train += time.perf_counter() - start
                updates.append((cid, new_state, result.num_samples))
                samples += result.samples_seen
            start = time.perf_counter()
            aggregate_updates(global_state, updates, inplace=True)  # as Simulation.run_round: into the model
            t_agg = time.perf_counter() - start
            print(
                f"{t:>5} {samples:>8} {t_route:>8.2f} {t_train:>8.2f} {t_agg:>12.3f} {t_route + t_train + t_agg:>8.2f}"
            )
        print(f"full supernet {count_params(sim.model.layout) / 1e6:.2f}M params")


if __name__ == "__main__":
    main()
