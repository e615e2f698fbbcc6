"""Seconds per round of one 4-client population on the MQTT path and on the Flower path, side by side, in one run.

    PYTHONPATH=. python3 bench/bench_flower_round.py [--rounds 3] [--samples 600] [--threads 1]

The population of bench_mqtt_round.py (fmnist-small, budgets 3M, 8M, 17.7M, 39.2M MACs, every client in every
round), written once with ``feast-edge partition``. A: feast-server + 4 feast-agent processes through the broker at
127.0.0.1:1883. B: a real flower-superlink + 4 flower-supernode processes on loopback (tests/flowerkit.py) running
the project ``feast-edge flower new`` writes, started with ``flwr run``. Both paths compute the same weights (the
same-math tests); what differs is how the cohort's slices travel. Per round: wall seconds (cohort sampling to
aggregated model), the slowest client's training, and the rest (the path's overhead); then the ratio B / A.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_mqtt_round import BUDGETS, mqtt_rounds, population, print_rounds  # noqa: E402

from feast_edge.flower.template import write_template  # noqa: E402
from feast_edge.run.checkpoint import read_record  # noqa: E402
from feast_edge.run.loop import CHECKPOINT, RoundRecord  # noqa: E402
from flowerkit import LocalFlower  # noqa: E402


def flower_rounds(config, tmp: Path, partition: Path, threads: int) -> tuple[list[RoundRecord], float]:
    """The same population through a local Flower deployment; its round history and the run's wall seconds."""
    app = tmp / "app"
    write_template(app, rounds=config.training.rounds, per_round=config.population.clients)
    run_config = {
        "out-dir": str(tmp / "flower-run"),
        "rounds": config.training.rounds,
        "per-round": config.population.clients,
        "min-clients": config.population.clients,
        "seed": 0,
        "round-timeout": 600.0,
        "wait-timeout": 300.0,
        "export": False,
    }
    with LocalFlower(tmp / "deployment") as flower:
        for i in range(config.population.clients):
            flower.supernode({"data": str(partition), "offset": i, "threads": threads})
        flower.wait_nodes(config.population.clients)
        run = flower.run(app, run_config, timeout=1800)
        if run.status != "finished:completed":
            raise SystemExit(f"the Flower run ended {run.status}: {run.details}\n{run.output}\n{flower.logs()}")
    fields = read_record(tmp / "flower-run" / CHECKPOINT)["fields"]
    return [RoundRecord.from_dict(h) for h in fields["history"]], run.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=600, help="training examples per client on average")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads per client")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = population(args.rounds, args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        mqtt, index = mqtt_rounds(config, tmp_path / "mqtt", args.broker, args.threads)
        flower, run_seconds = flower_rounds(config, tmp_path / "flower", tmp_path / "mqtt" / "partition", args.threads)
    sizes = [c["samples"] for c in index["clients"]]
    print(
        f"fmnist-small, {config.population.clients} clients (budgets {', '.join(f'{b / 1e6:.1f}M' for b in BUDGETS)}; {sizes} "
        f"examples), {args.rounds} rounds, torch {torch.__version__}, {args.threads} thread(s) per client, "
        f"{os.cpu_count()} CPUs"
    )
    a = print_rounds("A: MQTT path (feast-server, feast-agent, Mosquitto)", mqtt)
    b = print_rounds("B: Flower path (flower-superlink, flower-supernode, flwr run)", flower)
    print(f"Flower run from `flwr run` to finished (startup, query, rounds, checkpoints): {run_seconds:.1f} s")
    print(f"seconds per round: MQTT {a:.2f}, Flower {b:.2f}; Flower / MQTT = {b / a:.2f}x")


if __name__ == "__main__":
    main()
