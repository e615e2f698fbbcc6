"""Federated BN statistics against lying devices: each combination rule, 0-2 liars of 10, each lie (issue 35).

    PYTHONPATH=. python bench/bench_robust_bn.py [--rounds 8] [--clients 10] [--train-limit 8000] [--test-samples 2000]

Trains a FEAST simulation (fmnist-small, Zipf budgets, non-IID Dirichlet shards, seeded), then does what the server
without data does after the last round: every served variant (the largest each client can afford) gets the BN
statistics of the clients that can run it, on 500 examples of each client's own shard, combined by each rule of
feast_edge.evaluate.bn_robust. The liars are the clients with the largest budgets (they can run, so report for, every
variant) and lie in each of the ways issue 35 measured:

    huge      means 1e6, variances 1e12 (finite: they pass the format check)
    zero-var  variances 0, genuine means
    shifted   mean + 3σ per channel, variance x 0.25 (plausible)
    heavy     as huge, claiming 1,000,000 examples of weight

Then validation (issue 35's second lie): each round, every client tests the smallest variant on a held-out 20 % of
its shard; the liars report 100 % in round 1 and 0 % after. Prints the round each --val-rule chooses with 0-2 liars.

Prints, per rule, the honest clients' mean test accuracy of their served models (on --test-samples Fashion-MNIST
test images) for each attack and liar count, the honest devices' deviation scores (how far inside the bounds an
honest report sits), and the seconds each rule takes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from feast_edge.data.holdout import holdout_split
from feast_edge.evaluate.bn_robust import BN_RULES, SHIFT, SPREAD, Report, centre, deviation, robust_statistics
from feast_edge.evaluate.bn_stats import Stats, apply_statistics, bn_statistics
from feast_edge.evaluate.evaluation import calibrated_variant, correct_count
from feast_edge.evaluate.federated import (
    VAL_RULES,
    calibrated_static,
    calibration_subset,
    held_out_counts,
    robust_validation,
)
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.simulate import Simulation
from feast_edge.space.extract import extract


def lie(kind: str, stats: Stats) -> tuple[Stats, float | None]:
    """The statistics a liar sends instead of ``stats``, and the weight it claims (None: its true one)."""
    if kind in ("huge", "heavy"):
        lied = {n: (torch.full_like(m, 1e6), torch.full_like(v, 1e12)) for n, (m, v) in stats.items()}
        return lied, 1e6 if kind == "heavy" else None
    if kind == "zero-var":
        return {n: (m, torch.zeros_like(v)) for n, (m, v) in stats.items()}, None
    if kind == "shifted":
        return {n: (m + 3 * v.sqrt(), v * 0.25) for n, (m, v) in stats.items()}, None
    raise ValueError(kind)


def validation_table(rounds_seen: list, richest: list[str]) -> None:
    """Which round each validation rule chooses when 0-2 of the devices report 100 % in round 1 and 0 % after (issue
    35's lie), and the chosen round's test accuracy (the smallest variant, BN recalibrated) against the best possible."""
    best = max(acc for _, acc in rounds_seen)
    print(
        f"\nvalidation: the round each rule chooses (test accuracy of that round's smallest variant; the best round "
        f"had {100 * best:.2f}%, the last {100 * rounds_seen[-1][1]:.2f}%)"
    )
    print(f"{'rule':8s}" + "".join(f"{f'{n} liar(s)':>22s}" for n in (0, 1, 2)))
    for rule in VAL_RULES:
        cells = []
        for n in (0, 1, 2):
            liars, chosen, top = richest[:n], len(rounds_seen), -1.0
            for t, (counts, _) in enumerate(rounds_seen):
                reports = {
                    c: [(n_ if (c in liars and t == 0) else (0 if c in liars else k), n_)]
                    for c, (k, n_) in counts.items()
                }
                result = robust_validation(reports, 1, rule)
                if result.selects and result.accuracy is not None and result.accuracy > top:
                    chosen, top = t + 1, result.accuracy
            cells.append(f"round {chosen}: {100 * rounds_seen[chosen - 1][1]:6.2f}%")
        print(f"{rule:8s}" + "".join(f"{c:>22s}" for c in cells), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--train-limit", type=int, default=8000)
    parser.add_argument("--test-samples", type=int, default=2000)
    parser.add_argument("--calibration", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = SimulationConfig.of(
        preset="fmnist-small",
        clients=args.clients,
        per_round=args.clients // 2,
        rounds=args.rounds,
        train_limit=args.train_limit,
        val_samples=500,
        calib_samples=200,
        eval_every=10**6,
        seed=args.seed,
    )
    began = time.perf_counter()
    rounds_seen: list[tuple[dict[str, tuple[int, int]], float]] = []  # per round: client -> (correct, total), test acc
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(config, out)
        setup, preset = sim.setup, sim.preset
        test = setup.test_set
        images, labels = test.images[: args.test_samples], test.labels[: args.test_samples]
        probe = setup.cache.entries[0].arch  # the smallest variant: every client can run it
        splits = {}
        for c in setup.client_ids:
            x, y = setup.client_data(c)
            train, held = holdout_split(y, 0.2, seed=0)
            splits[c] = (x[train], y[train], x[held], y[held])
        for t in range(args.rounds):
            sim.run_round(t)
            counts = {
                c: held_out_counts(sim.model, [probe], x, hx, hy, 200, train_labels=y)[0]
                for c, (x, y, hx, hy) in splits.items()
                if len(hy)
            }
            calibration = calibration_subset(setup.train_set.images[:2000], 200)
            served = calibrated_variant(sim.model, probe, calibration)
            rounds_seen.append((counts, correct_count(served, images, labels, preset) / len(labels)))
            print(
                f"round {t + 1}/{args.rounds} trained and validated ({time.perf_counter() - began:.0f} s)", flush=True
            )
    budgets_by = dict(zip(setup.client_ids, setup.population.budgets))
    validation_table(rounds_seen, sorted(setup.client_ids, key=lambda c: -budgets_by[c]))
    budgets = dict(zip(setup.client_ids, setup.population.budgets))
    served = {c: setup.cache.largest_affordable(b) for c, b in budgets.items()}
    by_budget = sorted(setup.client_ids, key=lambda c: -budgets[c])
    data = {c: setup.client_data(c) for c in setup.client_ids}
    subsets = {c: calibration_subset(x, min(args.calibration, len(y))) for c, (x, y) in data.items()}
    variants = {e.arch: e for e in {id(e): e for e in served.values()}.values()}

    honest_reports: dict = {}
    for arch, entry in variants.items():
        model = extract(sim.model, arch)
        able = [c for c in setup.client_ids if budgets[c] >= entry.macs and len(data[c][1]) >= 8]
        honest_reports[arch] = (
            model,
            [(c, float(len(data[c][1])), bn_statistics(model, subsets[c], preset)) for c in able],
        )
    print(
        f"\n{len(variants)} served variants; contributors per variant: "
        + ", ".join(f"{e.macs / 1e6:.2f}M: {len(honest_reports[a][1])}" for a, e in variants.items())
    )

    scores = []
    for arch, (model, reports) in honest_reports.items():
        if len(reports) >= 3:
            middle, spread = centre([s for _, _, s in reports])
            scores += [deviation(s, middle, spread)[:2] for _, _, s in reports]
    if scores:
        print(
            f"honest reports' deviation (variants with >= 3 contributors): shift median {statistics.median(s for s, _ in scores):.3f}, "
            f"max {max(s for s, _ in scores):.3f} (bound {SHIFT}); spread median {statistics.median(r for _, r in scores):.3f}, "
            f"max {max(r for _, r in scores):.3f} (bound {SPREAD:.3f})"
        )

    def honest_accuracy(rule: str, kind: str, liars: list[str]) -> tuple[float, float, int]:
        accuracies, seconds, refused = [], 0.0, 0
        for arch, (model, reports) in honest_reports.items():
            sent = []
            for c, w, s in reports:
                if c in liars:
                    s, claimed = lie(kind, s)
                    w = claimed or w
                sent.append(Report(c, w, s))
            t0 = time.perf_counter()
            combined = robust_statistics(sent, rule)
            seconds += time.perf_counter() - t0
            refused += len(combined.refused)
            for client in (c for c, a in served.items() if a.arch == arch and c not in liars):
                if combined.stats is None:  # the device calibrates on its own data
                    x, y = data[client]
                    calibrated_static(model, preset, x, args.calibration, labels=y)
                else:
                    apply_statistics(model, combined.stats)
                accuracies.append(correct_count(model, images, labels, preset) / len(labels))
        return statistics.mean(accuracies), seconds, refused

    print(f"\nhonest clients' served models, mean test accuracy on {len(labels)} images (refused reports in brackets)")
    attacks = [("none", 0), *((k, n) for k in ("huge", "zero-var", "shifted", "heavy") for n in (1, 2))]
    header = (
        f"{'rule':10s}"
        + "".join(f"{k + ('' if n == 0 else f' x{n}'):>16s}" for k, n in attacks)
        + f"{'s/combine':>11s}"
    )
    print(header)
    for rule in ("mixture", *[r for r in BN_RULES if r != "mixture"]):
        cells, times = [], []
        for kind, n in attacks:
            acc, seconds, refused = honest_accuracy(rule, kind, by_budget[:n])
            cells.append(f"{100 * acc:6.2f}% [{refused}]")
            times.append(seconds / len(variants))
        print(f"{rule:10s}" + "".join(f"{c:>16s}" for c in cells) + f"{statistics.mean(times):11.4f}", flush=True)
    print(
        f"\n{config.preset}, {args.clients} clients, {args.rounds} rounds, train-limit {args.train_limit}, seed {args.seed}, "
        f"torch threads {torch.get_num_threads()}; {time.perf_counter() - began:.0f} s in all"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
