"""Secure aggregation over a real MQTT federation against the plain one (feast-server run --secure-agg): round time,
the extra stages' latency, each device's upload and key material, and accuracy, side by side in one run.

    PYTHONPATH=. python3 bench/bench_secagg_mqtt.py [--devices 6] [--rounds 3] [--samples 300] [--busy]

A partition of Fashion-MNIST over ``--devices`` clients whose budgets cycle through the fmnist-small cache (3M, 8M,
17.7M MACs); a feast-server (in this process) and one in-process feast-agent per client (one thread each) federate
through the broker at 127.0.0.1:1883 for ``--rounds`` rounds of every device, validated on the server's held-out split
after the last: once plain, once with --secure-agg (c = 1). Prints, per mode, the mean round time and the final
accuracy; for the secure run the time from a round's start to the roster (stage 1), to the boxes (stage 2) and the
unmask stage after the masked uploads (stage 4), the key material each device sent (keys, sealed shares, revealed
shares) and each device's upload against its plain fp32 upload. ``--busy`` runs a second busy process beside both.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _timing import machine  # noqa: E402
from slowagents import agents_running  # noqa: E402

import feast_edge.server.secure as secure  # noqa: E402
from feast_edge.agent.agent import Agent, AgentConfig  # noqa: E402
from feast_edge.agent.local_data import load_clients  # noqa: E402
from feast_edge.server.app import FederationServer, ServerConfig  # noqa: E402
from feast_edge.server.collect import PlainUploads  # noqa: E402
from feast_edge.sim.setup import SimulationConfig  # noqa: E402
from feast_edge.sim.shards import write_partition  # noqa: E402
from feast_edge.transport.broker import LinkConfig  # noqa: E402
from feast_edge.transport.retained import clear_retained  # noqa: E402

TIERS = (3e6, 8e6, 17.7e6)


def _spin() -> None:
    while True:
        pass


class Meter:
    """What a run's server saw: upload bytes per device, stage messages' bytes per device, stage times per round."""

    def __init__(self) -> None:
        self.uploads: dict[str, list[int]] = defaultdict(list)
        self.key_bytes: dict[str, list[int]] = defaultdict(list)
        self.stages: list[dict[str, float]] = []

    def install(self) -> list[tuple[object, str, object]]:
        """Wrap the server's hooks; returns what to restore."""
        meter, saved = self, []

        def wrap(owner: object, name: str, make) -> None:
            real = getattr(owner, name)
            saved.append((owner, name, real))
            setattr(owner, name, make(real))

        def check(real):
            def wrapped(self, reply, routed, global_state):
                meter.uploads[reply.device].append(reply.size)
                return real(self, reply, routed, global_state)

            return wrapped

        def on_message(real):
            def wrapped(self, message):
                meter.key_bytes[message.device].append(len(message.encode()))
                return real(self, message)

            return wrapped

        def show(real):
            def wrapped(self, stage, detail):
                if stage == "keys":
                    meter.stages.append({"start": time.monotonic()})
                meter.stages[-1].setdefault(stage, time.monotonic())
                return real(self, stage, detail)

            return wrapped

        wrap(PlainUploads, "check", check)
        wrap(secure.MaskedUploads, "check", check)
        wrap(secure.SecureStages, "on_message", on_message)
        wrap(secure.MqttSecureSums, "_show", show)
        return saved


def federate(partition: Path, out: Path, broker: str, names: list[str], **settings: object) -> dict[str, object]:
    federation = f"bench-{uuid.uuid4().hex[:8]}"
    config = ServerConfig.of(
        out=str(out), federation=federation, data=str(partition), seed=0, min_clients=len(names),
        start_clients=len(names), per_round=len(names), round_timeout=600.0, wait_timeout=300.0, server_opt="avg",
        **settings,
    )  # fmt: skip
    link = LinkConfig(broker=broker)
    meter = Meter()
    saved = meter.install()
    began = time.monotonic()

    def progress(record: object, total: int) -> None:
        print(f"  {time.monotonic() - began:6.1f} s  round {record.round}/{total}", file=sys.stderr, flush=True)  # type: ignore[attr-defined]

    server = FederationServer(config, link, on_round=progress)
    server.start()
    agents = [
        Agent(
            AgentConfig(host=name, federation=federation, preset="fmnist-small", threads=1, amp="off"),
            link,
            load_clients(partition / f"{name}.safetensors", name),
        )
        for name in names
    ]
    try:
        with agents_running(agents):
            history = server.run()
    finally:
        server.close()
        for owner, name, real in saved:
            setattr(owner, name, real)
        clear_retained(link, f"feast/{federation}/#")
    return {
        "round": statistics.mean(h.seconds for h in history),
        "val": history[-1].val_accuracy,
        "withheld": sum(len(h.withheld) for h in history),
        "meter": meter,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--devices", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=300, help="training examples per client")
    parser.add_argument("--busy", action="store_true", help="a second busy process beside both runs")
    args = parser.parse_args()
    budgets = tuple(TIERS[i % len(TIERS)] for i in range(args.devices))
    names = [f"client-{i:03d}" for i in range(args.devices)]
    print(f"{machine()}; {args.devices} devices ({', '.join(f'{b / 1e6:g}M' for b in budgets)}), {args.rounds} rounds, "
          f"{args.samples} examples each{'; a busy process beside' if args.busy else ''}")  # fmt: skip
    population = SimulationConfig.of(
        clients=args.devices, per_round=args.devices, rounds=args.rounds, budgets=budgets,
        train_limit=args.samples * args.devices, val_samples=500, calib_samples=200, seed=0,
    )  # fmt: skip
    busy = multiprocessing.Process(target=_spin, daemon=True) if args.busy else None
    if busy is not None:
        busy.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            partition = Path(tmp) / "partition"
            write_partition(population, partition)
            common = dict(rounds=args.rounds, eval_every=args.rounds)
            plain = federate(partition, Path(tmp) / "plain", args.broker, names, **common)
            safe = federate(partition, Path(tmp) / "secure", args.broker, names, secure_agg=True, **common)
    finally:
        if busy is not None:
            busy.terminate()
    for name, r in (("plain", plain), ("secure", safe)):
        print(f"{name:6}  round {r['round']:6.2f} s (mean)  val {100 * (r['val'] or 0):.2f} %  "
              f"segments withheld {r['withheld']}")  # fmt: skip
    print(f"secure / plain round time: {safe['round'] / plain['round']:.2f}")
    stages = safe["meter"].stages
    if stages:
        keys = statistics.mean(s.get("shares", s["start"]) - s["start"] for s in stages)
        shares = statistics.mean(s.get("masking", s["start"]) - s.get("shares", s["start"]) for s in stages)
        unmask = statistics.mean(s.get("done", s["start"]) - s.get("unmask", s["start"]) for s in stages)
        print(f"stage latency (mean of {len(stages)} rounds): keys {keys:.3f} s, sealed shares {shares:.3f} s "
              f"(both overlap training), unmask {unmask:.3f} s (after the uploads)")  # fmt: skip
    print(
        f"{'device':12} {'budget':>7} {'plain up (KiB)':>15} {'masked up (KiB)':>16} {'ratio':>6} {'key material (KiB)':>19}"
    )
    for name, budget in zip(names, budgets):
        up_plain = statistics.mean(plain["meter"].uploads[name]) / 1024
        up_safe = statistics.mean(safe["meter"].uploads[name]) / 1024
        keys = sum(safe["meter"].key_bytes[name]) / len(stages or [1]) / 1024
        print(f"{name:12} {budget / 1e6:6.1f}M {up_plain:15.1f} {up_safe:16.1f} {up_safe / up_plain:6.3f} {keys:19.1f}")


if __name__ == "__main__":
    main()
