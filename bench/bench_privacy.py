"""Accuracy against ε: client-level DP at several noise multipliers beside the same run without DP (issue 39).

One population (``--clients`` fmnist-small clients, ``--per-round`` per round, the paper's Zipf budgets), one seed,
one schedule; the runs differ only in ``--dp-*``: no DP, central DP at each of ``--noises`` (clip ``--clip``), and
local DP at ``--local`` (each client noises its own clipped update); with ``--adaptive Q``, each noise also with
adaptive clipping toward the Q quantile of the update norms (starting at ``--clip``). For each: ε at δ after the last round, the
population accuracy and the smallest and largest served variants' test accuracy, each as a ratio to the run without
DP, and the wall time. A ``feast-edge report`` of the runs (the privacy table and the accuracy-against-ε plot) is
written to ``WORK/report``.

    PYTHONPATH=. python3 bench/bench_privacy.py [--rounds 10] [--train-limit 12000] [--noises 0.5,1,2] [--local 1]
        [--clip 1.0] [--adaptive 0.5 --clip-lr 0.2] [--gamma 1] [--alpha-eff 0.45] [--work /tmp/bench-privacy]

Record the command, ``lscpu``'s model name and the table in docs/experiments.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from feast_edge.report.summary import write_report
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.simulate import Simulation


def runs(args: argparse.Namespace) -> dict[str, dict]:
    """name -> the config changes of each run, no DP first."""
    found = {"no DP": {}}
    for z in (float(v) for v in args.noises.split(",") if v):
        found[f"central z={z:g}"] = {"dp_clip": args.clip, "dp_noise": z}
        if args.adaptive:
            found[f"adaptive q={args.adaptive:g} z={z:g}"] = {
                "dp_clip": args.clip,
                "dp_noise": z,
                "dp_clip_quantile": args.adaptive,
                "dp_clip_lr": args.clip_lr,
            }
    if args.local:
        found[f"local z={args.local:g}"] = {"dp_clip": args.clip, "dp_noise": args.local, "dp_mode": "local"}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=12_000, help="client pool size (all: 0)")
    parser.add_argument("--test-limit", type=int, default=2_000)
    parser.add_argument("--noises", default="0.5,1,2")
    parser.add_argument("--local", type=float, default=1.0, help="local DP's noise multiplier (0: no local run)")
    parser.add_argument("--clip", type=float, default=1.0, help="the bound (adaptive clipping: the first round's)")
    parser.add_argument(
        "--adaptive", type=float, default=0.0, help="also each noise with adaptive clipping toward this quantile"
    )
    parser.add_argument("--clip-lr", type=float, default=0.2, help="adaptive clipping's step (--dp-clip-lr)")
    parser.add_argument("--gamma", type=float, default=1.0, help="data ∝ budget^gamma (0: independent of budget)")
    parser.add_argument("--alpha-eff", type=float, default=0.45, help="label skew: Dirichlet's effective alpha")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-privacy"))
    args = parser.parse_args()
    base = SimulationConfig.of(
        clients=args.clients,
        per_round=args.per_round,
        rounds=args.rounds,
        eval_every=args.rounds,
        train_limit=args.train_limit or None,
        test_limit=args.test_limit,
        seed=args.seed,
        gamma=args.gamma,
        alpha_eff=args.alpha_eff,
    )
    results, dirs = {}, []
    for name, changes in runs(args).items():
        out = args.work / name.replace(" ", "-").replace("=", "")
        config = base.changed(**changes)
        start = time.monotonic()
        print(f"{name}: {args.rounds} rounds ...", flush=True)
        found = Simulation(config, out).run(
            on_round=lambda p: print(f"  {name}: round {p.round}/{p.rounds}, loss {p.loss:.3f}", flush=True)
        )
        results[name] = (found, time.monotonic() - start)
        dirs.append(out)
    plain = results["no DP"][0]
    print()
    print("| run | ε (δ) | population acc. | smallest variant | largest variant | vs no DP (population) | seconds |")
    print("|---|---|---|---|---|---|---|")
    for name, (found, seconds) in results.items():
        privacy = found.get("privacy")
        eps = "∞" if privacy is None else f"{privacy['epsilon']:.3g} ({privacy['delta']:.2g})"
        if privacy and privacy.get("adaptive_clip"):
            eps += f", C {privacy['adaptive_clip']['first']:.3g} → {privacy['adaptive_clip']['last']:.3g}"
        variants = found["variants"]
        ratio = found["population_accuracy"] / plain["population_accuracy"]
        print(
            f"| {name} | {eps} | {100 * found['population_accuracy']:.2f} % | "
            f"{100 * variants[0]['test_accuracy']:.2f} % | {100 * variants[-1]['test_accuracy']:.2f} % | "
            f"{ratio:.2f}x | {seconds:.0f} |"
        )
    written = write_report(dirs, args.work / "report", title="Accuracy against ε (bench/bench_privacy.py)")
    print(f"\nreport: {written.report}")


if __name__ == "__main__":
    main()
