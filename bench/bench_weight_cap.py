"""What bounding self-reported sample counts costs honest devices, and what it limits, side by side.

    PYTHONPATH=. python bench/bench_weight_cap.py [--rounds 15] [--seeds 0 1] [--ratios 0 4] [--out /tmp/weight-cap]

1. **Cost** (honest population): the paper's γ = 1 Zipf population (10 clients, 5 per round, data shares
   proportional to budgets, so counts differ by an order of magnitude), one ``feast-edge simulate`` per seed
   and ``--max-weight-ratio`` (0: the paper's weights; r > 0: every shard size treated as self-reported and
   capped at r × the round's lower-median count). Prints population accuracy, the largest variant's accuracy
   and how many weights the cap lowered, with the difference to r = 0 on the same seed.
2. **Limit** (one attacker): starting from the trained r = 0 model of the first seed, one round with two
   honest 23-example devices (one real local step on their own Fashion-MNIST examples, the budget of the
   smallest and of the largest client) and one device that registers 1,000,000 examples and returns all
   zeros for the largest envelope. Prints, per ratio, the attacker's weight share on the positions all
   three cover and the relative L2 change of the global weights (1.0: erased).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.table import Table

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.aggregate.weights import bounded_weights
from feast_edge.cache.variants import load_cache
from feast_edge.cli.common import make_console
from feast_edge.data.images import FASHION_MNIST_DIR, load_fashion_mnist
from feast_edge.local.recipe import preset_recipe
from feast_edge.local.update import client_update
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.run.checkpoint import load_supernet
from feast_edge.space.preset import load_preset

POPULATION = ["--clients", "10", "--per-round", "5", "--gamma", "1", "--train-limit", "8000"]
EVALUATION = ["--val-samples", "1000", "--calib-samples", "200", "--test-limit", "2000"]


def simulate(out: Path, seed: int, ratio: float, rounds: int) -> dict:
    run = out / f"seed{seed}-r{ratio:g}"
    if not (run / "results.json").is_file():
        command = [sys.executable, "-m", "feast_edge.cli", "simulate", "--out", str(run), "--seed", str(seed)]
        command += ["--rounds", str(rounds), "--eval-every", str(rounds), "--threads", "2"]
        command += [*POPULATION, *EVALUATION, "--max-weight-ratio", str(ratio)]
        began = time.monotonic()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print(f"seed {seed}, r = {ratio:g}: {time.monotonic() - began:.0f} s", flush=True)
    results = json.loads((run / "results.json").read_text())
    capped = sum(len(r.get("capped", {})) for r in results["rounds"])
    largest = max(results["variants"], key=lambda v: v["macs"])
    return {
        "run": run,
        "population": results["population_accuracy"],
        "largest": largest["test_accuracy"],
        "capped": capped,
    }


def attack(run: Path, ratios: list[float]) -> list[tuple[float, float, float]]:
    preset = load_preset("fmnist-small")
    cache = load_cache(preset)
    model, _ = load_supernet(run / "checkpoint.safetensors", preset)
    state = model.state_dict()
    train = load_fashion_mnist(FASHION_MNIST_DIR, "train")
    recipe, _ = preset_recipe(preset.name)
    macs = [e.macs for e in cache.entries]
    updates = []
    for i, budget in enumerate((macs[0], macs[-1])):
        plan = plan_client(cache, budget)
        routed = route_state(state, plan.layout(preset, preset.classes), preset)
        images, labels = train.images[23 * i : 23 * (i + 1)], train.labels[23 * i : 23 * (i + 1)]
        new, _ = client_update(preset, preset.classes, plan, routed, images, labels, recipe, recipe.lr, seed=i)
        updates.append((f"honest-{i}", new, 23, False))
    plan = plan_client(cache, macs[-1])
    zeros = {k: torch.zeros_like(v) for k, v in route_state(state, plan.layout(preset, preset.classes), preset).items()}
    updates.append(("mallory", zeros, 1_000_000, True))
    norm = torch.sqrt(sum(v.double().pow(2).sum() for v in state.values() if v.is_floating_point()))
    rows = []
    for ratio in ratios:
        weights = bounded_weights([u[2] for u in updates], [u[3] for u in updates], ratio)
        after = aggregate_updates(state, [(c, s, w) for (c, s, _, _), w in zip(updates, weights)])
        change = torch.sqrt(
            sum((after[k].double() - v.double()).pow(2).sum() for k, v in state.items() if v.is_floating_point())
        )
        rows.append((ratio, weights[-1] / sum(weights), float(change / norm)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 4.0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/weight-cap"))
    args = parser.parse_args()
    ratios = sorted(set([0.0, *args.ratios]))
    console = make_console()
    table = Table(title=f"honest γ = 1 Zipf population, {args.rounds} rounds")
    for column in ("seed", "--max-weight-ratio", "weights capped", "population acc", "Δ", "largest variant", "Δ"):
        table.add_column(column, justify="right")
    first = None
    for seed in args.seeds:
        base = simulate(args.out, seed, 0.0, args.rounds)
        first = first or base["run"]
        for ratio in ratios:
            got = simulate(args.out, seed, ratio, args.rounds)
            table.add_row(
                str(seed),
                f"{ratio:g}" + (" (off)" if not ratio else ""),
                str(got["capped"]),
                f"{100 * got['population']:.2f} %",
                f"{100 * (got['population'] - base['population']):+.2f}",
                f"{100 * got['largest']:.2f} %",
                f"{100 * (got['largest'] - base['largest']):+.2f}",
            )
    console.print(table)
    attacked = Table(title="one attacker: 1,000,000 claimed examples, all-zero update, beside two 23-example devices")
    for column in ("--max-weight-ratio", "attacker's weight share", "relative change of the global weights"):
        attacked.add_column(column, justify="right")
    for ratio, share, change in attack(first, ratios):
        attacked.add_row(f"{ratio:g}" + (" (off)" if not ratio else ""), f"{share:.4f}", f"{change:.4f}")
    console.print(attacked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
