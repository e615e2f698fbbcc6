"""The learning rate of a federation without an end: constant against cosine cycles restarted every P rounds.

    python bench/bench_continuous_lr.py [--data fmnist|digits] [--rounds 60] [--stops 20,40,60] [--periods 0,10,20,40]
                                        [--seeds 0,1] [--clients 20] [--per-round 5] [--train-limit 4000]
                                        [--test-limit 2000] [--threads 2] [--work DIR]

A run without a horizon (``--continuous``) cannot decay its learning rate over --rounds: it serves whatever round
validation chose whenever it is asked, and it may be asked at any round. So each schedule is judged at several stops
of one run (``--stops``): the simulation stops there, the served model (the best validated round so far, method §8)
is tested on the test images, and the run goes on from its checkpoint to the next stop, as a service would. Each
schedule is one continuous simulation per seed (``SimulationConfig.of(continuous=True, lr_period=P)``; P = 0: the
constant learning rate); beside them, the finite run's cosine over exactly each stop's rounds, a run per stop: what a
user who knew the horizon in advance would get (the reference, not a schedule a service can use).

Figures: per schedule and stop, the mean over seeds of the population accuracy of the served models (each client's
largest affordable variant, method §9) on the test images, and the mean over stops; the schedule with the best mean
over stops is the default of ``--lr-period`` (feast_edge.local.recipe.CONTINUOUS_PERIOD). Prints progress lines and a
table; writes a record to bench/results/ (bench/_records.py).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _records import write_record

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.sim.config import SimulationConfig
from feast_edge.sim.simulate import Simulation


def _config(args: argparse.Namespace, seed: int, **changes: object) -> SimulationConfig:
    return SimulationConfig.of(
        data_dir=str(FASHION_MNIST_DIR),
        preset="fmnist-small",
        clients=args.clients,
        per_round=args.per_round,
        train_limit=args.train_limit,
        test_limit=args.test_limit,
        val_samples=1000,
        calib_samples=300,
        eval_every=args.eval_every,
        seed=seed,
        device="cpu",
        **changes,
    )


def _served_accuracy(result: dict) -> float:
    return float(result["population_accuracy"])


def run(args: argparse.Namespace) -> dict:
    stops = [int(s) for s in args.stops.split(",")]
    periods = [int(p) for p in args.periods.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-continuous-lr-"))
    figures: dict = {"stops": stops, "periods": periods, "seeds": seeds, "schedules": {}, "seconds": {}}
    began = time.monotonic()
    for seed in seeds:
        for period in periods:
            name = "constant" if period == 0 else f"restarts P={period}"
            out = work / f"seed{seed}-p{period}"
            for stop in stops:
                t0 = time.monotonic()
                sim = Simulation(_config(args, seed, rounds=stop, continuous=True, lr_period=period), out)
                result = sim.run(resume=(out / "checkpoint.safetensors").is_file())
                assert result is not None
                accuracy = _served_accuracy(result)
                figures["schedules"].setdefault(name, {}).setdefault(str(stop), []).append(accuracy)
                figures["seconds"][f"{name} seed {seed} stop {stop}"] = time.monotonic() - t0
                print(f"seed {seed} {name:>16} stop {stop:>3}: served {100 * accuracy:.2f}%  "
                      f"(round {sim.best.get('round')}, {time.monotonic() - began:.0f} s)", flush=True)  # fmt: skip
        for stop in stops:
            out = work / f"seed{seed}-cosine-{stop}"
            result = Simulation(_config(args, seed, rounds=stop), out).run()
            assert result is not None
            accuracy = _served_accuracy(result)
            figures["schedules"].setdefault("cosine over the stop (reference)", {}).setdefault(str(stop), []).append(
                accuracy
            )
            print(
                f"seed {seed}  cosine over {stop:>3}: served {100 * accuracy:.2f}%  ({time.monotonic() - began:.0f} s)",
                flush=True,
            )
    return figures


def table(figures: dict) -> list[str]:
    stops = [str(s) for s in figures["stops"]]
    lines = [f"{'schedule':<34}" + "".join(f"{'stop ' + s:>11}" for s in stops) + f"{'mean':>9}"]
    for name, by_stop in figures["schedules"].items():
        means = [statistics.mean(by_stop[s]) for s in stops]
        lines.append(
            f"{name:<34}" + "".join(f"{100 * m:>10.2f}%" for m in means) + f"{100 * statistics.mean(means):>8.2f}%"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stops", default="20,40,60")
    parser.add_argument("--periods", default="0,10,20,40")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--train-limit", type=int, default=4000)
    parser.add_argument("--test-limit", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    figures = run(args)
    for line in table(figures):
        print(line)
    chosen = max(
        (n for n in figures["schedules"] if not n.startswith("cosine")),
        key=lambda n: statistics.mean(statistics.mean(v) for v in figures["schedules"][n].values()),
    )
    figures["chosen"] = chosen
    print(f"best mean over the stops without a horizon: {chosen}")
    print(f"record: {write_record('continuous-lr', {**figures, 'settings': vars(args)})}")


if __name__ == "__main__":
    main()
