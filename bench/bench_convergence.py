"""How fast each server optimizer converges on the same population, side by side (issue 23).

    PYTHONPATH=. python bench/bench_convergence.py [--rounds 25] [--train-limit 4000] [--seed 0] [--jobs 2]
        [--grid avg:1 momentum:0.1 momentum:0.3 adam:0.003 adam:0.01 adam:0.03 yogi:0.01 yogi:0.03] [--out DIR]

Every run is ``feast-edge simulate`` of the same population: fmnist-small, 10 clients, 5 per round, the
paper's γ = 1 Zipf budgets, the preset's recipe, one seed; only ``--server-opt``/``--server-lr`` differ
(momentum 0.9, betas 0.9,0.99, τ 1e-3). Validation runs every round (the mean of 3 probe variants on
1,000 held-out images) so the rounds to 50 / 60 / 70 / 75 / 80 % are read off exactly. Each run has one process
and one PyTorch thread, ``--jobs`` runs at a time, so a run's summed round seconds are its CPU-seconds.

FedAvgM's step is about ``lr / (1 − momentum)`` times the round's mean change once the momentum has built up,
so ``momentum:0.1`` moves as far as plain averaging and ``momentum:0.3`` three times as far.

Prints, per optimizer and learning rate: rounds and CPU-seconds to 50 / 60 / 70 / 75 / 80 % validation (— where
never reached), the best and final validation accuracy, the population accuracy (each client served its
largest affordable variant, test split) and the largest variant's test accuracy. Runs already finished
in ``--out`` are read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

POPULATION = ["--clients", "10", "--per-round", "5", "--gamma", "1"]
EVALUATION = ["--eval-every", "1", "--val-samples", "1000", "--calib-samples", "200", "--test-limit", "2000"]
TARGETS = (0.50, 0.60, 0.70, 0.75, 0.80)
GRID = ["avg:1", "momentum:0.1", "momentum:0.3", "adam:0.003", "adam:0.01", "adam:0.03", "yogi:0.01", "yogi:0.03"]


def run_one(out: Path, opt: str, lr: float, args: argparse.Namespace) -> Path:
    """One simulation (skipped when its results are already there); returns its directory."""
    run = out / f"{opt}-lr{lr:g}-seed{args.seed}"
    if (run / "results.json").is_file():
        return run
    command = [sys.executable, "-m", "feast_edge.cli", "simulate", "--out", str(run), "--seed", str(args.seed)]
    command += ["--rounds", str(args.rounds), "--train-limit", str(args.train_limit), "--threads", "1"]
    command += [*POPULATION, *EVALUATION, "--server-opt", opt, "--server-lr", str(lr)]
    command += ["--resume"] if (run / "checkpoint.safetensors").is_file() else []  # an interrupted run continues
    began = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    print(f"{opt} lr {lr:g}: {time.monotonic() - began:.0f} s", flush=True)
    return run


def summary(run: Path) -> dict:
    """Rounds and CPU-seconds to each target, best/final validation, population and largest-variant accuracy."""
    results = json.loads((run / "results.json").read_text())
    rounds = results["rounds"]
    seconds, reached = 0.0, {}
    for r in rounds:
        seconds += r["seconds"]
        for target in TARGETS:
            if target not in reached and r["val_accuracy"] is not None and r["val_accuracy"] >= target:
                reached[target] = (r["round"], seconds)
    vals = [r["val_accuracy"] for r in rounds if r["val_accuracy"] is not None]
    largest = max(results["variants"], key=lambda v: v["macs"])
    return {
        "reached": reached,
        "best_val": max(vals),
        "final_val": vals[-1],
        "population": results["population_accuracy"],
        "largest": largest["test_accuracy"],
        "seconds": seconds,
        "curve": vals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--train-limit", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--grid", nargs="+", default=GRID, help="OPT:LR pairs")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-convergence"))
    args = parser.parse_args()
    grid = [(g.split(":")[0], float(g.split(":")[1])) for g in args.grid]
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda g: run_one(args.out, *g, args), grid))
    rows = [(opt, lr, summary(run)) for (opt, lr), run in zip(grid, runs)]
    table = Table(
        title=f"Server optimizers, fmnist-small, 10 clients (5/round, γ=1), {args.train_limit} examples, "
        f"{args.rounds} rounds, seed {args.seed}"
    )
    for col in ("optimizer", "server lr", *(f"to {t:.0%}: rounds / CPU-s" for t in TARGETS)):
        table.add_column(col, justify="left" if col == "optimizer" else "right")
    for col in ("best val", "final val", "population", "largest", "vs avg (pop.)"):
        table.add_column(col, justify="right")
    base = next((s for opt, lr, s in rows if opt == "avg" and lr == 1), None)
    for opt, lr, s in rows:
        cells = [f"{s['reached'][t][0]} / {s['reached'][t][1]:.0f}" if t in s["reached"] else "—" for t in TARGETS]
        delta = f"{100 * (s['population'] - base['population']):+.2f}" if base is not None else ""
        table.add_row(
            opt,
            f"{lr:g}",
            *cells,
            f"{100 * s['best_val']:.2f}%",
            f"{100 * s['final_val']:.2f}%",
            f"{100 * s['population']:.2f}%",
            f"{100 * s['largest']:.2f}%",
            delta,
        )
    Console(width=200).print(table)
    curves = {f"{opt}:{lr:g}": [round(v, 4) for v in s["curve"]] for opt, lr, s in rows}
    (args.out / "curves.json").write_text(json.dumps(curves, indent=1))
    print(f"validation curves: {args.out / 'curves.json'}, {plot(curves, args.out / 'curves.png')}")


def plot(curves: dict[str, list[float]], path: Path) -> Path:
    """Validation accuracy per round, one line per optimizer and learning rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, values in curves.items():
        ax.plot(
            range(1, len(values) + 1), [100 * v for v in values], label=label, linewidth=2 if label == "avg:1" else 1
        )
    ax.set_xlabel("round")
    ax.set_ylabel("validation accuracy (%, mean of 3 probe variants)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
