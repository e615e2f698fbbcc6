"""Personalization methods side by side on a simulated non-IID fleet: own held-out accuracy and device time.

    PYTHONPATH=. python bench/bench_personalize.py [--clients 20] [--alpha 0.1] [--rounds 10] [--per-round 10]
        [--train-limit 20000] [--device cpu|cuda] [--json FILE]

Trains one FEAST simulation (fmnist-small, Zipf budgets, Dirichlet(--alpha) shards, every client holding out 10 % of
its shard as the device agent does), then runs the device's personalization step (feast_edge.sim.personalize_clients, the code
`feast-edge simulate --personalize` runs) on every client's served variant once per choice: off, each method with the
strengths `auto` tries, and auto. Prints, per choice, the mean and worst decile of the clients' own held-out
accuracy, how many clients got a personal model, the mean test accuracy of the models the clients end with (what a
personal model forgets), and the device seconds the step took (per client, mean and max).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from feast_edge.evaluate.evaluation import correct_count
from feast_edge.personalize.select import METHODS, Choice, personal_step
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.simulate import Simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--train-limit", type=int, default=20000)
    parser.add_argument("--test-limit", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cpu = next(
        (ln.split(":", 1)[1] for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln), "?"
    )
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "no GPU"
    print(f"{platform.node()}: {cpu.strip()}, {gpu}, torch {torch.__version__}", flush=True)
    config = SimulationConfig.of(
        data_dir=args.data,
        clients=args.clients,
        per_round=args.per_round,
        rounds=args.rounds,
        alpha_eff=args.alpha,
        train_limit=args.train_limit,
        test_limit=args.test_limit,
        eval_every=args.rounds,
        holdout=0.1,
        personalize="auto",
        device=args.device,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(config, Path(out))
        began = time.perf_counter()
        sim.run(on_round=lambda p: print(f"round {p.round}/{p.rounds} loss {p.loss:.4f}", flush=True))
        print(f"federation: {time.perf_counter() - began:.0f} s", flush=True)
        setup, method = sim.setup, sim.method
        points = method.points()
        served = [method.served(float(b)) for b in setup.population.budgets]
        calibration = setup.calibration_images()
        test_images = setup.test_set.images[: args.test_limit]
        test_labels = setup.test_set.labels[: args.test_limit]
        networks = {i: method.point_network(points[i], calibration, args.device).cpu() for i in set(served)}
        choices = ["off", *(m for m in METHODS), "auto"]
        rows: dict[str, list[dict]] = {c: [] for c in choices}
        for client, index in zip(setup.client_ids, served):
            images, labels = setup.client_data(client)
            held_images, held_labels = setup.client_holdout(client)
            for choice in choices:
                began = time.perf_counter()
                outcome, own = personal_step(
                    networks[index], images, labels, held_images, held_labels, setup.preset, Choice.parse(choice),
                    seed=args.seed, device=args.device,
                )  # fmt: skip
                seconds = time.perf_counter() - began
                model = networks[index] if outcome.model is None else outcome.model
                rows[choice].append(
                    {
                        "client": client,
                        "macs": points[index].macs,
                        "examples": own.examples,
                        "served": own.served,
                        "personal": own.personal,
                        "method": outcome.method,
                        "strength": outcome.strength,
                        "test": correct_count(model, test_images, test_labels, setup.preset) / len(test_labels),
                        "seconds": seconds,
                    }
                )
            print(f"{client}: {len(labels)} training, {len(held_labels)} held out; done", flush=True)
    print(f"\n{args.clients} clients, Dirichlet({args.alpha}), {args.rounds} rounds, device {args.device}")
    print(
        f"{'choice':10s} {'own mean':>9s} {'own worst 10%':>14s} {'personalized':>13s} {'test mean':>10s} {'s/client':>9s} {'s max':>7s}"
    )
    for choice, found in rows.items():
        measured = [r for r in found if r["examples"]]
        own = sorted(r["personal"] / r["examples"] for r in measured)
        k = max(1, len(own) // 10)
        print(
            f"{choice:10s} {100 * statistics.fmean(own):8.2f}% {100 * statistics.fmean(own[:k]):13.2f}% "
            f"{sum(1 for r in found if r['method']):>7d} of {len(found):<3d} "
            f"{100 * statistics.fmean(r['test'] for r in found):9.2f}% "
            f"{statistics.fmean(r['seconds'] for r in found):9.2f} {max(r['seconds'] for r in found):7.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
