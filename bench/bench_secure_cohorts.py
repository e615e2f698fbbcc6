"""Secure rounds that never serve slices that never trained: withheld segments and served variants, before vs after.

    PYTHONPATH=. python bench/bench_secure_cohorts.py [--rounds 8] [--zipf-rounds 30] [--train-limit 1200]
                                                      [--zipf-train-limit 600] [--test-limit 1000]

``feast-edge simulate --secure-agg`` (c = 1: a segment's sum is revealed over at least 3 clients), in this process,
one PyTorch thread, the same seed for both sides:

* **before**: the previous release's secure rounds: the uniform draw of m, every client routed its whole affordable
  set, each served its largest affordable variant (the simulation's scheduler set back to
  feast_edge.run.schedule.SyncRounds; its served variants taken as the largest affordable);
* **after**: this release's: the stratified draw, plans capped at what the round reveals, each client served its
  largest affordable variant whose every slice trained (feast_edge.run.stratified).

Part 1, the six-device fleet of issue 66 on fmnist-small: budgets 2M x3 (the smallest variant only), 8M (variants
0-8) and 40M x2 (all 26), all six every round, ``--rounds`` rounds, ``--train-limit`` Fashion-MNIST training images:
which segments are withheld per round, which variant each client is served, whether a served variant holds a slice no
release moved, each client's served test accuracy against the best affordable variant whose slices all trained.

Part 2, a 20-client Zipf fleet (simulate's population: 1.5M-100M MACs, seed 0), 5 a round, ``--zipf-rounds``
rounds, ``--zipf-train-limit`` training images spread near-IID and alike (``alpha_eff`` 10, ``gamma`` 0: only the rounds' plans are measured
here, and few images keep the rounds short): the withheld segments per round before vs after, and the members the
round's cap routed less than their affordable set.

The figures are printed and written as a record in bench/results/ (bench/_records.py): the command, the CPU
(lscpu), the date, the commit and the figures. Its tables in docs/benchmarks.md: bench/tables/secure_cohorts.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import REPO, write_record  # noqa: E402
from bench_async import cpu, say  # noqa: E402

from feast_edge.route.plans import plan_client  # noqa: E402
from feast_edge.run.cohort import inclusion  # noqa: E402
from feast_edge.run.schedule import SyncRounds  # noqa: E402
from feast_edge.sim.setup import SimulationConfig  # noqa: E402
from feast_edge.sim.simulate import Simulation  # noqa: E402

SIX = (2e6, 2e6, 2e6, 8e6, 40e6, 40e6)


def run(config: SimulationConfig, out: Path, before: bool, finish: bool) -> tuple[Simulation, dict | None, dict]:
    """One simulation; ``before``: the previous release's uniform draw and uncapped plans. Returns it, its results
    (``finish``: the whole run, every variant tested; else its rounds only) and, per round, how many members were
    routed less than their affordable set."""
    sim = Simulation(config, out)
    if before:
        sim.loop.scheduler = SyncRounds(sim.loop.settings, sim.method, sim.model)
    capped: dict[int, int] = {}
    cache, budgets = sim.setup.cache, sim.collector.inner.budgets

    def seen(t: int, cohort: list[str], plans: dict) -> None:
        capped[t + 1] = sum(plans[c] != plan_client(cache, budgets[c]) for c in cohort)

    sim.collector.inner.on_start = seen
    if finish:
        return sim, sim.run(), capped
    sim.history.extend(sim.run_round(t) for t in range(config.training.rounds))
    return sim, None, capped


def withheld(sim: Simulation) -> list[list[str]]:
    """Per round, the members of each withheld segment."""
    return [sorted(h.withheld) for h in sim.history]


def six_fleet(args: argparse.Namespace, work: Path) -> dict:
    config = SimulationConfig.of(
        preset="fmnist-small", clients=6, per_round=6, rounds=args.rounds, budgets=SIX, train_limit=args.train_limit,
        val_samples=500, calib_samples=200, test_limit=args.test_limit, eval_every=args.rounds, probe_variants=1,
        seed=0, secure_agg=True, colluders=1, device="cpu",
    )  # fmt: skip
    figures: dict = {"budgets": list(SIX), "per_round": 6, "rounds": args.rounds, "train_limit": args.train_limit}
    for side in ("before", "after"):
        say(f"six devices, {side}: {args.rounds} rounds, then every variant tested")
        began = time.perf_counter()
        sim, results, capped = run(config, work / f"six-{side}", side == "before", finish=True)
        assert results is not None
        cache = sim.setup.cache
        accuracy = [v["test_accuracy"] for v in results["variants"]]
        trained = [bool(v["trained"]) for v in results["variants"]]
        budgets = results["population"]["budgets"]
        largest = [cache.entries.index(cache.largest_affordable(b)) for b in budgets]
        served = largest if side == "before" else results["served"]
        clients = []
        for i, b in enumerate(budgets):
            affordable = range(largest[i] + 1)
            best = max(affordable, key=lambda k: (trained[k], accuracy[k]) if trained[k] else (False, 0.0))
            clients.append(
                {
                    "client": f"client-{i:03d}",
                    "budget_macs": b,
                    "served": served[i],
                    "served_macs": cache.entries[served[i]].macs,
                    "served_never_updated": not trained[served[i]],
                    "served_test_accuracy": accuracy[served[i]],
                    "best_trained": best,
                    "best_trained_test_accuracy": accuracy[best],
                }
            )
        figures[side] = {
            "withheld_per_round": withheld(sim),
            "capped_members_per_round": [capped[h.round] for h in sim.history],
            "trained_variants": [k for k, ok in enumerate(trained) if ok],
            "clients": clients,
            "population_accuracy": statistics.mean(c["served_test_accuracy"] for c in clients),
            "seconds": time.perf_counter() - began,
        }
    return figures


def zipf_fleet(args: argparse.Namespace, work: Path) -> dict:
    config = SimulationConfig.of(
        preset="fmnist-small", clients=20, per_round=5, rounds=args.zipf_rounds, train_limit=args.zipf_train_limit,
        val_samples=500, calib_samples=200, eval_every=args.zipf_rounds, probe_variants=1, seed=0, secure_agg=True,
        colluders=1, device="cpu", alpha_eff=10.0, gamma=0.0,
    )  # fmt: skip
    figures: dict = {"clients": 20, "per_round": 5, "rounds": args.zipf_rounds}
    for side in ("before", "after"):
        say(f"Zipf fleet, {side}: {args.zipf_rounds} rounds")
        began = time.perf_counter()
        sim, _, capped = run(config, work / f"zipf-{side}", side == "before", finish=False)
        counts = [len(w) for w in withheld(sim)]
        figures[side] = {
            "withheld_per_round": counts,
            "mean_withheld": statistics.mean(counts),
            "rounds_with_any_withheld": sum(n > 0 for n in counts),
            "capped_members_per_round": [capped[h.round] for h in sim.history],
            "seconds": time.perf_counter() - began,
        }
        if side == "after":  # the draw's DP price: the largest per-client inclusion probability against m / N
            reveal = sim.loop.scheduler.reveal
            tiers = [reveal.tier(b) for b in sim.collector.inner.budgets.values()]
            cap = reveal.cap(tiers)
            sizes = Counter(min(t, cap) for t in tiers)
            figures["tiers"] = [sizes[k] for k in sorted(sizes)]
            figures["largest_inclusion"] = max(inclusion(figures["tiers"], 5, 3))
            figures["uniform_inclusion"] = 5 / 20
    return figures


def report(six: dict, zipf: dict) -> None:
    for side in ("before", "after"):
        part = six[side]
        rounds = sum(bool(w) for w in part["withheld_per_round"])
        print(f"\nsix devices, {side}: withheld in {rounds} of {six['rounds']} rounds "
              f"({', '.join(sorted({m for w in part['withheld_per_round'] for m in w})) or 'none'}); "
              f"trained variants {part['trained_variants'][0]}-{part['trained_variants'][-1]} "
              f"({len(part['trained_variants'])} of 26); population accuracy {100 * part['population_accuracy']:.2f} %")  # fmt: skip
        print("| client | budget | served | never-updated slice | served test acc. | best trained variant | its acc. |")
        print("|---|---:|---:|---|---:|---:|---:|")
        for c in part["clients"]:
            print(f"| {c['client']} | {c['budget_macs'] / 1e6:g}M | {c['served']} ({c['served_macs'] / 1e6:.2f}M) | "
                  f"{'yes' if c['served_never_updated'] else 'no'} | {100 * c['served_test_accuracy']:.2f} % | "
                  f"{c['best_trained']} | {100 * c['best_trained_test_accuracy']:.2f} % |")  # fmt: skip
    for side in ("before", "after"):
        part = zipf[side]
        print(f"\nZipf fleet, {side}: withheld segments per round {part['mean_withheld']:.2f} (max "
              f"{max(part['withheld_per_round'])}), rounds with any {part['rounds_with_any_withheld']} of "
              f"{zipf['rounds']}; capped members per round {statistics.mean(part['capped_members_per_round']):.2f}")  # fmt: skip
    print(f"Zipf fleet tiers {zipf['tiers']}: largest inclusion probability {zipf['largest_inclusion']:.4f} against "
          f"{zipf['uniform_inclusion']:.2f} for a uniform draw")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the six-device fleet")
    parser.add_argument("--zipf-rounds", type=int, default=30, help="rounds of the Zipf fleet")
    parser.add_argument("--train-limit", type=int, default=1200, help="Fashion-MNIST training images, all clients")
    parser.add_argument("--zipf-train-limit", type=int, default=600, help="training images of the Zipf fleet")
    parser.add_argument("--test-limit", type=int, default=1000, help="test images the six-device fleet is tested on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    say(f"CPU: {cpu()}; torch {torch.__version__}, one thread")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        six = six_fleet(args, Path(work))
        zipf = zipf_fleet(args, Path(work))
    report(six, zipf)
    figures = {"threads": 1, "seconds": time.perf_counter() - began, "six_devices": six, "zipf": zipf}
    say(f"wrote {write_record('secure-cohorts', figures).relative_to(REPO)}")


if __name__ == "__main__":
    main()
