"""Per-round overhead of the MQTT path: round wall time minus the slowest client's compute, 4 local agents, CPU preset.

    PYTHONPATH=. python3 bench/bench_mqtt_round.py [--broker mqtt://127.0.0.1:1883] [--rounds 3] [--samples 600] [--threads 1]

A partition of Fashion-MNIST over 4 clients whose budgets span the fmnist-small
cache (3M, 8M, 17.7M, 39.2M MACs); a feast-server (in this process) and 4
feast-agent processes (one per client, ``--threads`` each) federate through the
broker, every client in every round. Per round the server records its wall time
(cohort sampling to aggregated model), the time to route, encode and publish
the 4 routed payloads, the aggregation time, and each agent's reported local
training time. The MQTT path's overhead is the wall time minus the slowest
client's compute: waiting for payloads, decoding, encoding, uploading,
validation of the uploads and aggregation.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from feast_edge.server.app import FederationServer, ServerConfig  # noqa: E402
from feast_edge.sim.setup import SimulationConfig  # noqa: E402
from feast_edge.sim.shards import write_partition  # noqa: E402
from feast_edge.transport.broker import LinkConfig  # noqa: E402
from feast_edge.transport.retained import clear_retained  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BUDGETS = (3e6, 8e6, 17.7e6, 39.2e6)


def population(rounds: int, samples: int) -> SimulationConfig:
    """The benchmark's population: one client per budget, every client in every round."""
    n = len(BUDGETS)
    return SimulationConfig.of(
        clients=n,
        per_round=n,
        rounds=rounds,
        budgets=BUDGETS,
        train_limit=samples * n,
        val_samples=200,
        calib_samples=100,
        seed=0,
    )


def mqtt_rounds(config: SimulationConfig, tmp_path: Path, broker: str, threads: int) -> tuple[list, dict]:
    """A feast-server (this process) and one feast-agent process per client of ``config``'s partition, through
    ``broker``; the server's round history and the partition index."""
    n = config.population.clients
    index = write_partition(config, tmp_path / "partition")
    federation = f"bench-{uuid.uuid4().hex[:8]}"
    server = FederationServer(
        ServerConfig.of(
            out=str(tmp_path / "run"),
            rounds=config.training.rounds,
            per_round=n,
            min_clients=n,
            round_timeout=600.0,
            seed=0,
            federation=federation,
            wait_timeout=300.0,
        ),
        LinkConfig(broker=broker),
    )
    server.start()
    history: list = []
    thread = threading.Thread(target=lambda: history.extend(server.run()), daemon=True)
    thread.start()
    agents = []
    for entry in index["clients"]:
        log = open(tmp_path / f"{entry['client_id']}.log", "w")
        agents.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "feast_edge.agent.cli",
                    "run",
                    "--insecure",
                    "--broker",
                    broker,
                    "--device-id",
                    entry["client_id"],
                    "--data",
                    str(tmp_path / "partition" / entry["file"]),
                    "--federation",
                    federation,
                    "--threads",
                    str(threads),
                    "--log-level",
                    "warning",
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        )
    try:
        thread.join(1800)
    finally:
        for a in agents:
            a.send_signal(signal.SIGTERM)
        for a in agents:
            a.wait(30)
        server.close()
        clear_retained(LinkConfig(broker=broker), f"feast/{federation}/#")  # the presences this run left retained
    return history, index


def print_rounds(path: str, history: list) -> float:
    """One line per round (wall, slowest client's compute, the rest); returns the mean wall seconds per round."""
    print(f"{path}:")
    print(
        f"{'round':>5} {'wall s':>8} {'slowest compute s':>18} {'overhead s':>11} {'overhead %':>11} {'route+send s':>13} {'aggregate s':>12}"
    )
    for h in history:
        slowest = max(h.compute_seconds.values())
        overhead = h.seconds - slowest
        print(
            f"{h.round:>5} {h.seconds:>8.2f} {slowest:>18.2f} {overhead:>11.2f} {100 * overhead / h.seconds:>10.1f}% {h.send_seconds:>13.3f} {h.aggregate_seconds:>12.3f}"
        )
    mean = sum(h.seconds - max(h.compute_seconds.values()) for h in history) / len(history)
    print(f"mean {path} overhead per round: {mean:.2f} s")
    return sum(h.seconds for h in history) / len(history)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=600, help="training examples per client on average")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads per agent")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = population(args.rounds, args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        history, index = mqtt_rounds(config, Path(tmp), args.broker, args.threads)
        sizes = [c["samples"] for c in index["clients"]]
        print(
            f"fmnist-small, {config.population.clients} agents (budgets {', '.join(f'{b / 1e6:.1f}M' for b in BUDGETS)}; {sizes} examples), "
            f"broker {args.broker}, torch {torch.__version__}, {args.threads} thread(s) per agent, {os.cpu_count()} CPUs"
        )
        print_rounds("MQTT path", history)


if __name__ == "__main__":
    main()
