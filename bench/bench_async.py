"""Synchronous against buffered asynchronous rounds on the virtual clock: time to accuracy, accuracy per tier.

    python bench/bench_async.py [--rounds 30] [--clients 20] [--per-round 5] [--train-limit 4000] [--seed 0]
                                [--sweep 5x10,10x20:0.5,5x10:0.25:constant] [--compute-factor 1] [--jobs 2]
                                [--work DIR [--reuse]]

Two fleets of ``--clients`` Zipf clients (fmnist-small, data proportional to budget), their speeds following their
budgets on the virtual clock (feast_edge.run.clock): ``tiers``, and ``stragglers`` (a seeded 20 % of the clients
10 times slower). On each fleet, at the same total client compute (the sync run's training MACs, given to the others
as ``--compute-budget``: an asynchronous release of fast devices' updates is far cheaper than a round):

    sync          --rounds synchronous rounds of --per-round clients, each waiting for its slowest member
    sync-p80      the same with --round-timeout at the 80th percentile of the sync run's job times (late
                  updates dropped, as a server's deadline drops them), until the compute budget
    async KxM     buffered asynchronous rounds, K updates per release, M clients training at once, until the
                  compute budget

``--compute-factor F`` gives the asynchronous runs F times the sync run's compute: how soon they reach its final
accuracy when they may train past it. The sync runs validate every 2 rounds, the asynchronous ones every 4 releases, on the server's split
(--val-samples 1000). Printed per fleet: the virtual time
each run needed to reach the sync run's final validation accuracy (and its ratio to sync's), the final accuracy of
the served variants on the test set over all clients and per budget tier (quartiles of the budgets: the top tier
alone trains the top slices), the staleness and the participation of the slowest tier. Runs go ``--jobs`` at a time,
one PyTorch thread each, as ``feast-edge simulate`` subprocesses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FLEETS = {"tiers": [], "stragglers": ["--stragglers", "0.2", "--straggler-factor", "10"]}
TIERS = 4


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def cpu() -> str:
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        return " ".join(
            fields.get(k, "").strip() for k in ("Model name", "CPU family", "Model") if fields.get(k, "").strip()
        )
    except OSError:
        return platform.processor()


def simulate(name: str, options: list[str], out: Path, reuse: bool = False) -> dict:
    """One ``feast-edge simulate`` run (one thread); its results.json (``reuse``: a finished run's in ``out`` with the
    same options, without running it again)."""
    began = time.monotonic()
    asked = out / "bench-options.json"
    if reuse and (out / "results.json").is_file() and asked.is_file() and json.loads(asked.read_text()) == options:
        say(f"  {name}: reused from {out}")
        return json.loads((out / "results.json").read_text())
    command = [sys.executable, "-m", "feast_edge.cli.main", "simulate", "--out", str(out), "--threads", "1", *options]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    asked.write_text(json.dumps(options))
    say(f"  {name}: {time.monotonic() - began:.0f} s, virtual {results['timeline']['virtual_seconds']:.0f} s")
    return results


def reached(results: dict, target: float) -> float | None:
    """The virtual time of the first validation at or above ``target`` (None: never)."""
    return next((t for t, a in results["timeline"]["accuracy_vs_time"] if a >= target - 1e-12), None)


def tiers(results: dict) -> tuple[list[float], list[list[int]]]:
    """Per budget quartile (lowest first): the mean test accuracy of the clients' served variants, and the clients."""
    budgets = results["population"]["budgets"]
    accuracy = {v["index"]: v["test_accuracy"] for v in results["variants"]}
    served = results["served"]
    order = sorted(range(len(budgets)), key=lambda i: budgets[i])
    groups = [order[k * len(order) // TIERS : (k + 1) * len(order) // TIERS] for k in range(TIERS)]
    return [statistics.mean(accuracy[served[i]] for i in g) for g in groups], groups


def async_run(text: str) -> tuple[int, int, float | None, str | None]:
    """``KxM[:η[:discount]]`` of --sweep: a server step η (--server-lr) and a staleness discount (--staleness); none
    given: the mode's defaults."""
    pair, eta, discount, *_ = [*text.split(":"), "", ""]
    k, m = (int(x) for x in pair.split("x"))
    return k, m, float(eta) if eta else None, discount or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--train-limit", type=int, default=4000)
    parser.add_argument("--test-limit", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep", default="5x10,10x20", help="async runs: KxM[:η[:discount]] (--server-lr, --staleness)"
    )
    parser.add_argument(
        "--compute-factor", type=float, default=1.0, help="the async runs' compute, in multiples of the sync run's"
    )
    parser.add_argument("--no-p80", action="store_true", help="leave out the sync-p80 baseline")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--fleets", default=",".join(FLEETS))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--reuse", action="store_true", help="reuse the finished runs in --work that had the same options"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-async-"))
    pairs = [async_run(p) for p in args.sweep.split(",") if p]
    updates = args.rounds * args.per_round
    base = [
        "--preset", "fmnist-small", "--clients", str(args.clients), "--per-round", str(args.per_round),
        "--train-limit", str(args.train_limit), "--test-limit", str(args.test_limit), "--seed", str(args.seed),
        "--val-samples", "1000", "--calib-samples", "200",
    ]  # fmt: skip
    say(f"CPU: {cpu()}; {os.cpu_count()} cores; {args.jobs} runs at a time, one thread each; work in {work}")
    summary = {}
    for fleet in args.fleets.split(","):
        say(f"fleet {fleet}")
        runs: dict[str, dict] = {}
        sync_options = [*base, *FLEETS[fleet], "--eval-every", "2"]
        runs["sync"] = simulate(
            f"{fleet} sync", [*sync_options, "--rounds", str(args.rounds)], work / fleet / "sync", args.reuse
        )
        times = sorted(t for r in runs["sync"]["rounds"] for t in r["durations"].values())
        p80 = times[min(len(times) - 1, math.ceil(0.8 * len(times)) - 1)]
        budget = f"{runs['sync']['compute']['train_macs_total']:.6g}"
        say(f"  compute budget {float(budget) / 1e12:.2f} TMAC; sync-p80 timeout {p80:.1f} virtual s")
        limit = ["--compute-budget", budget]
        more = ["--compute-budget", f"{args.compute_factor * float(budget):.6g}"]
        jobs = {"sync-p80": [*sync_options, "--round-timeout", f"{p80:.3f}", "--rounds", str(4 * args.rounds), *limit]}
        if args.no_p80:
            del jobs["sync-p80"]
        for k, m, eta, discount in pairs:
            releases = math.ceil(40 * args.compute_factor) * max(1, round(updates / k))  # the compute budget ends it
            step = [] if eta is None else ["--server-lr", str(eta)]
            step += [] if discount is None else ["--staleness", discount]
            name = (
                f"async {k}x{m}" + ("" if eta is None else f" η={eta}") + ("" if discount is None else f" {discount}")
            ) + ("" if args.compute_factor == 1 else f" x{args.compute_factor:g} compute")
            jobs[name] = [
                *base, *FLEETS[fleet], "--eval-every", "4", "--mode", "async", "--buffer", str(k),
                "--concurrency", str(m), "--rounds", str(releases), *step, *more,
            ]  # fmt: skip
        with ThreadPoolExecutor(args.jobs) as pool:
            done = {
                name: pool.submit(
                    simulate, f"{fleet} {name}", options, work / fleet / name.replace(" ", "-"), args.reuse
                )
                for name, options in jobs.items()
            }
            runs.update({name: future.result() for name, future in done.items()})
        target = next(x["val_accuracy"] for x in reversed(runs["sync"]["rounds"]) if x["val_accuracy"] is not None)
        sync_time = reached(runs["sync"], target)
        rows = []
        for name, r in runs.items():
            at = reached(r, target)
            by_tier, groups = tiers(r)
            t = r["timeline"]
            rows.append(
                {
                    "run": name,
                    "steps": len(r["rounds"]),
                    "train_macs": r["compute"]["train_macs_total"],
                    "virtual_seconds": t["virtual_seconds"],
                    "to_sync_final": at,
                    "ratio": None if at is None or not sync_time else at / sync_time,
                    "final_val": next(
                        x["val_accuracy"] for x in reversed(r["rounds"]) if x["val_accuracy"] is not None
                    ),
                    "population_accuracy": r["population_accuracy"],
                    "tiers": by_tier,
                    "staleness": t["staleness"],
                    "late": t["late"],
                    "updates": sum(t["participation"].values()),
                    "tier_updates": [sum(t["participation"].get(f"client-{i:03d}", 0) for i in g) for g in groups],
                }
            )
        summary[fleet] = {"p80": p80, "target": target, "rows": rows}
        print(
            f"\nfleet {fleet}: target = sync's final validation accuracy {100 * target:.2f} % "
            f"(sync-p80 timeout {p80:.1f} virtual s)"
        )
        print(
            "| run | steps | TMAC | virtual time | time to target | / sync | final val | test, all clients | test per tier "
            "(lowest budget quartile first) | staleness mean / max / refused | late | updates per tier |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|")
        for row in rows:
            to = "never" if row["to_sync_final"] is None else f"{row['to_sync_final']:.0f} s"
            ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
            st = row["staleness"]
            print(
                f"| {row['run']} | {row['steps']} | {row['train_macs'] / 1e12:.2f} | {row['virtual_seconds']:.0f} s | {to} | {ratio} | {100 * row['final_val']:.2f} % "
                f"| {100 * row['population_accuracy']:.2f} % | "
                + " / ".join(f"{100 * a:.1f}" for a in row["tiers"])
                + f" | {st['mean']:.2f} / {st['max']} / {st['refused']} | {row['late']} | "
                + " / ".join(str(n) for n in row["tier_updates"])
                + " |"
            )
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    say(f"figures in {work / 'summary.json'}")


if __name__ == "__main__":
    main()
