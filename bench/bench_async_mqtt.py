"""Wall time of a real MQTT federation with one device five times slower than the others: synchronous rounds, which
wait for it every round, against buffered asynchronous releases (feast-server run --mode async).

    PYTHONPATH=. python3 bench/bench_async_mqtt.py [--rounds 6] [--releases 32] [--samples 600] [--slow 5]
        [--buffer 3] [--busy]

A partition of Fashion-MNIST over 4 clients whose budgets span the fmnist-small cache (3M, 8M, 17.7M, 39.2M MACs);
a feast-server (in this process) and 4 in-process feast-agents (one thread each) federate through the broker at
127.0.0.1:1883. The strongest device, the only one that trains the top slices, is made ``--slow`` times slower
(tests/slowagents.py: before each upload it sleeps (slow - 1) times what its round took). Synchronous: ``--rounds``
rounds of all 4 devices, validated on the server's held-out split after the last. Asynchronous: ``--releases``
releases of ``--buffer`` updates, 4 devices training at once, validated every ``--eval-every`` releases. Prints each
mode's wall time, its released updates, the slow device's released, lost and trained updates, and the validation
accuracy; then the asynchronous run's time to the synchronous run's final accuracy, and its ratio to the
synchronous wall time. ``--busy`` runs a second busy process beside both.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _timing import machine  # noqa: E402
from slowagents import agents_running, slow_down  # noqa: E402

from feast_edge.agent.agent import Agent, AgentConfig  # noqa: E402
from feast_edge.agent.local_data import load_clients  # noqa: E402
from feast_edge.server.app import FederationServer, ServerConfig  # noqa: E402
from feast_edge.sim.setup import SimulationConfig  # noqa: E402
from feast_edge.sim.shards import write_partition  # noqa: E402
from feast_edge.transport.broker import LinkConfig  # noqa: E402
from feast_edge.transport.retained import clear_retained  # noqa: E402

BUDGETS = (3e6, 8e6, 17.7e6, 39.2e6)
NAMES = [f"client-{i:03d}" for i in range(len(BUDGETS))]


def _spin() -> None:
    while True:
        pass


def federate(partition: Path, out: Path, broker: str, slow: float, **settings: object) -> dict[str, object]:
    """One federation of the partition's 4 clients, the last one ``slow`` times slower; what it took and gave."""
    federation = f"bench-{uuid.uuid4().hex[:8]}"
    config = ServerConfig.of(
        out=str(out), federation=federation, data=str(partition), seed=0, min_clients=4, start_clients=4,
        round_timeout=600.0, wait_timeout=300.0, **settings,
    )  # fmt: skip
    link = LinkConfig(broker=broker)
    began = time.monotonic()

    def progress(record: object, total: int) -> None:
        print(f"  {time.monotonic() - began:6.1f} s  step {record.round}/{total}", file=sys.stderr, flush=True)  # type: ignore[attr-defined]

    server = FederationServer(config, link, on_round=progress)
    server.start()
    agents = [
        Agent(
            AgentConfig(host=name, federation=federation, preset="fmnist-small", threads=1, amp="off"),
            link,
            load_clients(partition / f"{name}.safetensors", name),
        )
        for name in NAMES
    ]
    slow_down(agents[-1], slow)
    try:
        with agents_running(agents):
            began = time.monotonic()
            history = server.run()
            wall = time.monotonic() - began
    finally:
        server.close()
        clear_retained(link, f"feast/{federation}/#")
    slow_name = NAMES[-1]
    lost = sum(slow_name in {*h.rejected, *h.incomplete, *h.missing, *h.dropped, *h.declined} for h in history)
    return {
        "wall": wall,
        "steps": len(history),
        "updates": sum(len(h.updated) for h in history),
        "slow_released": sum(slow_name in h.updated for h in history),
        "slow_lost": lost,
        "slow_trained": agents[-1].rounds_trained,
        "staleness_max": max((max(h.staleness.values(), default=0) for h in history), default=0),
        "val": history[-1].val_accuracy,
        "validated": [(h.clock, h.val_accuracy) for h in history if h.val_accuracy is not None],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--rounds", type=int, default=6, help="synchronous rounds (4 updates each)")
    parser.add_argument("--samples", type=int, default=600, help="training examples per client")
    parser.add_argument("--slow", type=float, default=5.0, help="how many times slower the strongest device is")
    parser.add_argument("--buffer", type=int, default=3, help="asynchronous: updates per release (K)")
    parser.add_argument("--releases", type=int, default=32, help="asynchronous releases")
    parser.add_argument("--eval-every", type=int, default=4, help="asynchronous: validate every this many releases")
    parser.add_argument("--busy", action="store_true", help="a second busy process beside both runs")
    args = parser.parse_args()
    print(f"{machine()}; {args.samples} examples per client, the {BUDGETS[-1] / 1e6:g}M device {args.slow:g}x slower")
    population = SimulationConfig.of(
        clients=4, per_round=4, rounds=args.rounds, budgets=BUDGETS, train_limit=args.samples * 4,
        val_samples=500, calib_samples=200, seed=0,
    )  # fmt: skip
    busy = multiprocessing.Process(target=_spin, daemon=True) if args.busy else None
    if busy is not None:
        busy.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            partition = Path(tmp) / "partition"
            write_partition(population, partition)
            modes = {
                "sync": dict(rounds=args.rounds, per_round=4, eval_every=args.rounds),
                "async": dict(
                    mode="async", rounds=args.releases, buffer=args.buffer, concurrency=4, max_staleness=20,
                    eval_every=args.eval_every, per_round=4,
                ),
            }  # fmt: skip
            results = {}
            for name, settings in modes.items():
                results[name] = r = federate(partition, Path(tmp) / name, args.broker, args.slow, **settings)
                print(
                    f"{name:5}  {r['wall']:7.1f} s  {r['steps']} steps, {r['updates']} updates released; slow device: "
                    f"{r['slow_released']} released, {r['slow_lost']} lost, {r['slow_trained']} trained; max staleness "
                    f"{r['staleness_max']}; val {100 * (r['val'] or 0):.2f} %",
                    flush=True,
                )
    finally:
        if busy is not None:
            busy.terminate()
    sync, asynchronous = results["sync"], results["async"]
    target = sync["val"] or 0.0
    reached = next((t for t, acc in asynchronous["validated"] if t is not None and acc >= target), None)
    print(f"async / sync wall time (whole runs): {asynchronous['wall'] / sync['wall']:.2f}")
    if reached is None:
        print(f"async never reached the synchronous final accuracy {100 * target:.2f} %")
    else:
        print(
            f"async reached the synchronous final accuracy {100 * target:.2f} % after {reached:.1f} s: "
            f"{reached / sync['wall']:.2f} of the synchronous wall time"
        )


if __name__ == "__main__":
    main()
