"""Versions over a simulated month: canaries and the install gate against no gate, a one-shot model and weekly
restarts, on one fleet whose folders grow, whose devices join, one of which drifts and one of which lies.

    PYTHONPATH=. python bench/bench_versions_month.py [--quick] [--days 28] [--rounds-per-day 2] [--clients 20]
        [--per-round 5] [--train-limit 4000] [--canary 0.2] [--restart-rounds so-far|N] [--seed 0] [--work DIR]

The fleet (in process, the virtual clock, ``SimulationConfig.of(continuous=True, validate_on="devices")``): Fashion-MNIST
on the fmnist-small preset, ``--clients`` devices in four budget tiers (2M, 6M, 15M and 40M MACs, a quarter each), each
with a Dirichlet shard of a ``--train-limit`` pool of which 20 % is its test split (``--test-split``: never trained,
validated or gated on) and 15 % of the rest its held-out split. A virtual day is ``--rounds-per-day`` rounds of
``--per-round`` devices; the devices validate once a day (``--eval-every`` = a day's rounds), so the served round and
with it the version changes at most daily. Population over time (feast_edge.sim.growth): every device present on day
1 but one for each later week, which joins at that week's start (days 8, 15 and 22 of 28); each folder holds 20 % of its
training images when its device joins and grows by 80 % of them over the month (``--shard-growth``), so that a device
gains about 0.8 n / days images a day (n: its training images, reported); one device drifts (``--drift-clients 1``:
the images it gains come class after class) and one lies (``--lying-validators 1``: its held-out figures are 100 %
at its first validation and 0 % after, and every version a regression when it is a canary).

Strategies, on the same seed and data:
    (a) gate      --versions --canary SHARE --install-gate on: the continuous run; every version goes to canaries
                  (one per tier at least), then to everyone if promoted, each device installing it only if it is
                  not worse than the one it runs on its held-out split
    (b) no gate   the same versions offered to every present device, each installed (--install-gate off); versions
                  never change training, so (b) replays (a)'s versions (its served weights after each change, in
                  order, on the same steps) through the same module with the gate off instead of training again
    (c) one-shot  the model served after day 1 (the same run's first day), installed by each device when it is
                  present and never replaced
    (d) restart   the day-1 model for week 1; at the start of each later week a new model trained from scratch
                  (a finite run of ``--restart-rounds`` rounds, default: as many rounds as the month so far, on the
                  population frozen as it stands then, feast_edge.sim.growth.Growth.frozen_at), installed by every
                  present device

Per device, each virtual day: the test accuracy of the model it runs (each device's served variant, BN recalibrated
on the training images it holds, as agents do). Over the month: bytes moved (the training payloads both ways, plus
every version offered: its served variant's float32 weights), client compute (training MACs plus the gate's forward
MACs), installs, refusals, rollbacks (none: nothing rolls back automatically), canary holds, and the installs that
are regressions on the device's test split (new accuracy below the previous model's by more than one standard error of
the paired difference). Prints progress lines and a table; writes a JSON record to bench/results/ (bench/_records.py)
and a PNG of the mean test accuracy over days per strategy beside it.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _records import write_record

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.loop import BEST
from feast_edge.sim.config import SimulationConfig
from feast_edge.sim.setup import build_setup
from feast_edge.sim.simulate import Simulation
from feast_edge.sim.versions import Installed, SimulatedVersions, measured_accuracy, outcomes, served_network

TIERS = (2e6, 6e6, 15e6, 40e6)
STRATEGIES = ("gate", "no-gate", "one-shot", "restart")


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def config(args: argparse.Namespace, **changes: object) -> SimulationConfig:
    rounds = args.days * args.rounds_per_day
    # One device joins at the start of each week after the first (days 8, 15, 22 of a 28-day month): the last of
    # the L late ones at the start of the last week.
    late = max(1, args.days // args.week - 1)
    budgets = tuple(TIERS[i * len(TIERS) // args.clients] for i in range(args.clients))
    base = dict(  # noqa: C408 (the settings by key, as SimulationConfig.of takes them)
        data_dir=str(FASHION_MNIST_DIR),
        preset="fmnist-small",
        clients=args.clients,
        budgets=budgets,
        per_round=args.per_round,
        train_limit=args.train_limit,
        val_samples=100,
        calib_samples=args.calib,
        test_limit=100,
        probe_variants=2,
        seed=args.seed,
        validate_on="devices",
        holdout=0.15,
        test_split=0.2,
        eval_every=args.rounds_per_day,
        rounds=rounds,
        continuous=True,
        joined_at_start=(args.clients - late) / args.clients,
        join_rounds=late * args.week * args.rounds_per_day,
        shard_start=0.2,
        shard_growth=0.8 / rounds,
        drift_clients=1,
        lying_validators=1,
        device="cpu",
    )
    return SimulationConfig.of(**{**base, **changes})


def paired_se(new: torch.Tensor, old: torch.Tensor) -> float:
    """The standard error of the mean paired difference new - old (per-example correctness)."""
    d = new.float() - old.float()
    n = d.numel()
    return float(d.std(unbiased=True) / math.sqrt(n)) if n > 1 else 0.0


class Fleet:
    """What one strategy's devices run, measured on their test splits; counts its installs that regress there."""

    def __init__(self, setup, name: str) -> None:
        self.setup, self.name = setup, name
        self.running: dict[str, Installed] = {}
        self.daily: list[dict[str, float | None]] = []
        self.regressions: list[dict] = []
        self.installs = 0  # installs that replaced a model (not a device's first)
        self.firsts = 0

    def changed(self, before: dict[str, Installed], after: dict[str, Installed], t: int) -> None:
        """Count the installs between ``before`` and ``after`` and those worse on the test split by more than 1 SE."""
        for device, now in after.items():
            was = before.get(device)
            if was is None:
                self.firsts += 1
                continue
            if was is now:
                continue
            self.installs += 1
            images, labels = self.setup.client_test(device, t)
            if not labels.numel():
                continue
            new, old = (
                outcomes(now.network, images, labels, self.setup),
                outcomes(was.network, images, labels, self.setup),
            )
            fall = float(old.float().mean() - new.float().mean())
            if fall > paired_se(new, old):
                self.regressions.append(
                    {"device": device, "step": t, "old": float(old.float().mean()), "new": float(new.float().mean())}
                )
        self.running = dict(after)

    def measure(self, t: int, present: list[str]) -> None:
        self.daily.append(
            {
                d: measured_accuracy(self.setup, self.running[d].network, d, t) if d in self.running else None
                for d in present
            }
        )


def install_all(fleet: Fleet, model, present: list[str], budgets: dict, t: int, calib: int, only_new: bool) -> int:
    """Every present device (``only_new``: those that run nothing) installs ``model``'s served variant; the bytes moved."""
    moved = 0
    after = dict(fleet.running)
    for device in present:
        if only_new and device in after:
            continue
        network, entry = served_network(fleet.setup, model, device, budgets[device], t, calib)
        after[device] = Installed(0, network, entry, t)
        moved += entry.params * 4
    fleet.changed(fleet.running, after, t)
    return moved


def mean(values) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 virtual days, 8 devices: a smoke run")
    parser.add_argument("--days", type=int, default=28)
    parser.add_argument("--rounds-per-day", type=int, default=2)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--train-limit", type=int, default=4000)
    parser.add_argument("--calib", type=int, default=100, help="BN-calibration images per device")
    parser.add_argument("--canary", type=float, default=0.2)
    parser.add_argument(
        "--restart-rounds", default="so-far", help="rounds of each weekly restart (so-far: the month's so far)"
    )
    parser.add_argument("--week", type=int, default=7, help="days between restarts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.days, args.clients, args.per_round, args.train_limit, args.week = 4, 8, 4, 1200, 2
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-versions-"))
    R, days = args.rounds_per_day, args.days
    began = time.time()

    # (a) the continuous run with canaries and the gate; its versions' weights kept for (b), its day-1 model for (c), (d)
    cfg = config(args, versions=True, canary=args.canary, install_gate="on")
    setup = build_setup(cfg)
    sim = Simulation(cfg, work / "gate", setup=setup)
    fleet_a = sim.environment.versions
    assert fleet_a is not None
    budgets = dict(fleet_a.budgets)
    growth = setup.growth
    ids = setup.client_ids
    gate, versions, state = Fleet(setup, "gate"), [], {"count": 0}
    present_of = fleet_a.present
    say(
        f"{len(ids)} devices, budgets {sorted(set(budgets.values()))}, drifting {list(growth.drifting)}, "
        f"lying {sorted(fleet_a.liars)}, joining at steps {sorted(s for s in growth.joined.values() if s)}"
    )

    def on_round(record) -> None:
        t = record.round - 1
        count = len(fleet_a.book.versions())
        if count > state["count"]:
            state["count"] = count
            model, _ = load_supernet(work / "gate" / BEST, setup.preset)
            versions.append((copy.copy(record), model))
        gate.changed(gate.running, fleet_a.running, t)
        if record.round % R == 0:
            gate.measure(t, present_of(t))
            say(f"(a) day {record.round // R}: versions {count}, mean test accuracy {mean(gate.daily[-1].values())}")

    sim.loop.run(on_round=on_round, stop_after=days * R)
    train_a = sum(h.train_macs for h in sim.history)
    bytes_a = 2 * sum(h.routed_bytes for h in sim.history)
    counts_a = fleet_a.book.counts()
    holds = sum(1 for v in fleet_a.book.versions() if v.state == "held")
    say(f"(a) done: {counts_a}, {holds} held, {time.time() - began:.0f} s")

    # (b) the same versions, the gate off
    fleet_b = SimulatedVersions(
        setup, versions[0][1] if versions else sim.model, budgets, canary=0.0, gated=False, seed=cfg.seed,
        calibration=cfg.validation.calib_samples, out=None, liars=fleet_a.liars,
    )  # fmt: skip
    no_gate = Fleet(setup, "no-gate")
    queue = list(versions)
    for step in range(days * R):
        while queue and queue[0][0].round - 1 == step:
            record, model = queue.pop(0)
            fleet_b.model = model
            fleet_b.served(record)
            no_gate.changed(no_gate.running, fleet_b.running, step)
        if (step + 1) % R == 0:
            no_gate.measure(step, present_of(step))
    say(f"(b) done: {fleet_b.book.counts()}, {time.time() - began:.0f} s")

    # (c) one-shot: the model served after day 1
    day1 = [m for r, m in versions if r.round <= R]
    first_model = day1[-1] if day1 else versions[0][1]
    one_shot, bytes_c = Fleet(setup, "one-shot"), 0
    for day in range(1, days + 1):
        t = day * R - 1
        bytes_c += install_all(one_shot, first_model, present_of(t), budgets, t, cfg.validation.calib_samples, True)
        one_shot.measure(t, present_of(t))
    train_day1 = sum(h.train_macs for h in sim.history[:R])
    bytes_day1 = 2 * sum(h.routed_bytes for h in sim.history[:R])
    say(f"(c) done, {time.time() - began:.0f} s")

    # (d) weekly restarts from scratch on the data so far
    restart, bytes_d, train_d, restarts = Fleet(setup, "restart"), 0, train_day1, []
    model = first_model
    for day in range(1, days + 1):
        t = day * R - 1
        if day > 1 and (day - 1) % args.week == 0:  # the start of a week: a new model on the data of the days before
            frozen = (day - 1) * R - 1
            rounds = (day - 1) * R if args.restart_rounds == "so-far" else int(args.restart_rounds)
            rcfg = config(args, rounds=rounds, continuous=False, eval_every=R)
            rsetup = build_setup(rcfg)
            rsetup.growth = rsetup.growth.frozen_at(frozen)
            rsim = Simulation(rcfg, work / f"restart-{day}", setup=rsetup)
            rsim.loop.run()
            model = rsim.loop.load(rsim.loop.selected_checkpoint())[0]
            train_d += sum(h.train_macs for h in rsim.history)
            bytes_d += 2 * sum(h.routed_bytes for h in rsim.history)
            restarts.append(
                {"day": day, "data_of_step": frozen + 1, "rounds": rounds, "served_round": rsim.best.get("round")}
            )
            bytes_d += install_all(restart, model, present_of(t), budgets, t, cfg.validation.calib_samples, False)
            say(f"(d) restart before day {day}: {rounds} rounds, {time.time() - began:.0f} s")
        else:
            bytes_d += install_all(restart, model, present_of(t), budgets, t, cfg.validation.calib_samples, True)
        restart.measure(t, present_of(t))
    bytes_d += bytes_day1

    fleets = {"gate": gate, "no-gate": no_gate, "one-shot": one_shot, "restart": restart}
    last = {name: f.daily[-1] for name, f in fleets.items()}
    liars = set(fleet_a.liars)
    honest = [d for d in last["gate"] if d not in liars]
    below = {
        other: [d for d in honest if (last["gate"][d] or 0) < (last[other].get(d) or 0)]
        for other in ("one-shot", "restart")
    }
    gate_macs = sum(fleet_a.macs.values())
    figures = {
        "sizes": {
            "devices": len(ids),
            "days": days,
            "rounds_per_day": R,
            "rounds": days * R,
            "per_round": args.per_round,
            "train_limit": args.train_limit,
            "tiers_macs": list(TIERS),
            "canary": args.canary,
            "week_days": args.week,
            "training_images": dict(growth.sizes),
            "images_per_day": {d: 0.8 * n / days for d, n in growth.sizes.items()},
            "drifting": list(growth.drifting),
            "lying": sorted(liars),
            "joined_day": {d: s // R + 1 for d, s in growth.joined.items()},
            "restarts": restarts,
        },
        "daily_mean_test_accuracy": {name: [mean(day.values()) for day in f.daily] for name, f in fleets.items()},
        "final_test_accuracy": last,
        "installs": {
            "gate": {"replaced": gate.installs, "first": gate.firsts, "book": counts_a, "canary_holds": holds},
            "no-gate": {"replaced": no_gate.installs, "first": no_gate.firsts, "book": fleet_b.book.counts()},
            "one-shot": {"replaced": one_shot.installs, "first": one_shot.firsts},
            "restart": {"replaced": restart.installs, "first": restart.firsts},
        },
        "refusals": counts_a.get("refused", 0),
        "rollbacks": 0,
        "test_regressions": {name: f.regressions for name, f in fleets.items()},
        "test_regressions_per_100_installs": {
            name: (100 * len(f.regressions) / f.installs if f.installs else None) for name, f in fleets.items()
        },
        "bytes": {
            "gate": bytes_a + sum(fleet_a.moved.values()),
            "no-gate": bytes_a + sum(fleet_b.moved.values()),
            "one-shot": bytes_day1 + bytes_c,
            "restart": bytes_d,
        },
        "client_macs": {
            "gate": train_a + gate_macs,
            "no-gate": train_a + sum(fleet_b.macs.values()),
            "one-shot": train_day1,
            "restart": train_d,
        },
        "gate_forward_macs": gate_macs,
        "targets": {
            "gate_test_regressions_per_100_installs_le_1": (100 * len(gate.regressions) / max(1, gate.installs)) <= 1,
            "honest_devices_below_one_shot": below["one-shot"],
            "honest_devices_below_restart": below["restart"],
            "compute_ratio_gate_to_restart": (train_a + gate_macs) / train_d if train_d else None,
        },
        "seconds": time.time() - began,
    }
    print()
    print(
        f"{'strategy':10s} {'final mean acc':>15s} {'installs':>9s} {'test regr.':>11s} {'GB moved':>9s} {'TMAC':>8s}"
    )
    for name, f in fleets.items():
        print(
            f"{name:10s} {100 * (mean(last[name].values()) or 0):14.1f}% {f.installs:9d} {len(f.regressions):11d} "
            f"{figures['bytes'][name] / 1e9:9.3f} {figures['client_macs'][name] / 1e12:8.2f}"
        )
    print(f"refusals {figures['refusals']}, canary holds {holds}, rollbacks 0; targets: {figures['targets']}")
    if not args.no_record:
        path = write_record("versions-month" + ("-quick" if args.quick else ""), figures)
        plot(figures, path.with_suffix(".png"), R)
        say(f"record: {path.relative_to(REPO)}")


def plot(figures: dict, path: Path, rounds_per_day: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in figures["daily_mean_test_accuracy"].items():
        ax.plot(range(1, len(values) + 1), [100 * (v or 0) for v in values], marker=".", label=name)
    ax.set_xlabel(f"virtual day ({rounds_per_day} rounds a day)")
    ax.set_ylabel("mean test accuracy of the installed models (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
