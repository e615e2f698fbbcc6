"""Payload throughput through an MQTT broker: feast_edge.transport's chunked transfer vs one raw paho publish of the same bytes.

Both methods publish with QoS 1 from this process to a receiver in a child
process, through the broker. The clock runs from the call that starts the
send (for chunked: hashing, framing, pipelined chunks) until the receiver holds
the whole payload (for chunked: reassembled and SHA-256 verified); the
receiver stamps ``time.monotonic()``, which is one system-wide clock on Linux.
Methods alternate within each repetition so load drift hits both alike.

    PYTHONPATH=. python3 bench/bench_mqtt_throughput.py [--broker URL] [--sizes 20 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feast_edge.transport.broker import LinkConfig  # noqa: E402
from feast_edge.transport.chunks import Progress, Status  # noqa: E402
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE, MiB  # noqa: E402
from feast_edge.transport.link import Link, Received  # noqa: E402
from feast_edge.transport.topics import Topics  # noqa: E402
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender  # noqa: E402

DEVICE = "bench"


def bench_topics(federation: str) -> dict[str, str]:
    base = f"feastbench/{federation}"
    return {"raw": f"{base}/raw", "done": f"{base}/done", "ready": f"{base}/ready", "stop": f"{base}/stop"}


def receiver(broker: str, federation: str) -> None:
    """Child process: receive both kinds of payload and report when each is complete."""
    names = bench_topics(federation)
    link = Link(LinkConfig(broker=broker))
    link.connect(timeout=10)
    stop = threading.Event()

    def done(method: str, size: int, ok: bool) -> None:
        report = {"method": method, "t": time.monotonic(), "size": size, "ok": ok}
        link.publish(names["done"], json.dumps(report).encode())

    def on_chunked(progress: Progress) -> None:
        done("chunked", progress.info.size, progress.status is Status.COMPLETE)

    def on_raw(message: Received) -> None:
        done("raw", len(message.payload), True)

    ChunkReceiver(link, Topics(federation), "down", device=DEVICE, on_result=on_chunked)
    link.subscribe(names["raw"], on_raw)
    link.subscribe(names["stop"], lambda message: stop.set())
    link.publish(names["ready"], b"1", timeout=10)
    stop.wait(600)
    link.close()


class Reports:
    """Completion reports from the receiver."""

    def __init__(self) -> None:
        self.items: list[dict[str, object]] = []
        self.changed = threading.Condition()

    def __call__(self, message: Received) -> None:
        with self.changed:
            self.items.append(json.loads(message.payload))
            self.changed.notify_all()

    def next(self, timeout: float) -> dict[str, object]:
        with self.changed:
            if not self.changed.wait_for(lambda: bool(self.items), timeout):
                raise TimeoutError(f"receiver reported nothing within {timeout} s")
            return self.items.pop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 50], help="payload sizes in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--window", type=int, default=16, help="chunks in flight awaiting PUBACK")
    parser.add_argument("--receiver", metavar="FEDERATION", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receiver(args.broker, args.receiver)
        return

    federation = f"bench{os.getpid()}"
    names = bench_topics(federation)
    link = Link(LinkConfig(broker=args.broker, max_inflight=max(32, args.window)))
    link.connect(timeout=10)
    reports = Reports()
    link.subscribe(names["done"], reports)
    ready = threading.Event()
    link.subscribe(names["ready"], lambda message: ready.set())
    sender = ChunkSender(link, Topics(federation), "down", chunk_size=args.chunk_size, window=args.window)
    child = subprocess.Popen([sys.executable, __file__, "--broker", args.broker, "--receiver", federation])
    try:
        if not ready.wait(30):
            raise SystemExit("receiver process did not come up within 30 s")

        def raw(payload: bytes) -> float:
            start = time.monotonic()
            link.publish(names["raw"], payload, qos=1)
            return float(reports.next(120)["t"]) - start  # type: ignore[arg-type]

        def chunked(payload: bytes) -> float:
            start = time.monotonic()
            sender.send(payload, round=0, device=DEVICE, timeout=120)
            report = reports.next(120)
            assert report["ok"], "chunked transfer was rejected"
            return float(report["t"]) - start  # type: ignore[arg-type]

        print(
            f"broker {args.broker}, QoS 1, chunk {args.chunk_size / MiB:g} MiB, window {args.window}, "
            f"{args.repeats} repeats (median), receiver in a child process"
        )
        print(f"{'payload':>9} {'raw MiB/s':>10} {'chunked MiB/s':>14} {'chunked/raw':>12}")
        ratios = []
        for size in args.sizes:
            payload = os.urandom(size * MiB)
            chunked(payload[:MiB])  # warm both paths up
            raw(payload[:MiB])
            seconds: dict[str, list[float]] = {"raw": [], "chunked": []}
            for repeat in range(args.repeats):
                order = [("raw", raw), ("chunked", chunked)]
                for name, method in order if repeat % 2 == 0 else order[::-1]:
                    seconds[name].append(method(payload))
            rate = {name: size / statistics.median(values) for name, values in seconds.items()}
            ratios.append(rate["chunked"] / rate["raw"])
            print(f"{size:>5} MiB {rate['raw']:>10.1f} {rate['chunked']:>14.1f} {ratios[-1]:>12.2f}")
        print(f"chunked/raw throughput ratio: min {min(ratios):.2f}, target >= 0.70")
    finally:
        link.publish(names["stop"], b"1", timeout=10)
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        link.close()


if __name__ == "__main__":
    main()
