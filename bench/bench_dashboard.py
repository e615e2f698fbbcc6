"""The dashboard's added per-round cost on the server: without it, with it serving nobody, with a browser connected.

Part 1 times what ``feast-server run --dashboard`` adds to the server's run
thread per round: the live view's bookkeeping (fleet refresh from the registry,
routed payloads, ~5 progress reports per device, the round's end) for fleets of
4, 50 and 200 devices, and the cost of one snapshot as the page receives it
(``snapshot()`` + JSON), which the web thread pays on every change while a
browser is connected.

Part 2 runs the server's heaviest per-round step, the sparse aggregation of a
cohort (``bench_aggregate.routed_cohort``, 5 clients of fmnist-small), in the
run thread while (A) no dashboard runs, (B) the dashboard serves but nobody is
connected, (C) a client holds the live event stream open and the state changes
20 times a second, as device reports make it do during a round. Each phase
runs at least 3 s; A, B and C run in turn, three times, in one process; the
ratios are what the dashboard costs.

    PYTHONPATH=. python3 bench/bench_dashboard.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from bench.bench_aggregate import routed_cohort
from feast_edge.aggregate.sparse import aggregate
from feast_edge.cache.variants import load_cache
from feast_edge.dashboard import DashboardState, start_dashboard
from feast_edge.run.loop import RoundRecord
from feast_edge.server.live import LiveView
from feast_edge.server.registry import Registry
from feast_edge.space.preset import load_preset


def live_round_cost(devices: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one round's live-view calls, and of one snapshot + JSON, for ``devices`` devices."""
    preset = load_preset("fmnist-small")
    cache = load_cache(preset)
    with tempfile.TemporaryDirectory() as tmp:
        registry = Registry(Path(tmp) / "devices.sqlite")
        names = [f"device-{i:03d}" for i in range(devices)]
        for i, name in enumerate(names):
            budget = int(1_500_000 + (i * 37_000_000) // max(1, devices - 1))
            registry.register(
                name,
                host=name,
                instance="i",
                budget_macs=budget,
                samples=100,
                preset=preset.name,
                profile={"name": "laptop-cpu"},
                status="online",
            )
        state = DashboardState("federation", "bench")
        view = LiveView(state, preset, cache, registry, rounds=1000, federation="bench")
        online = set(names)
        rounds, snapshots = [], []
        for t in range(repeats):
            began = time.perf_counter()
            view.refresh(online, force=True)
            view.round_started(t, names, 300.0)
            for name in names:
                view.routed(name, 400_000, 1, 100_000)
                for done in (0, 1):
                    view.device_progress(name, {"phase": "downloading", "round": t, "done": done, "total": 1})
                view.device_progress(name, {"phase": "training", "round": t})
                view.upload_progress(name, 1, 1)
                view.upload_done(name, 400_000, 1)
            view.round_finished(
                RoundRecord(
                    round=t + 1,
                    lr=0.05,
                    cohort=names,
                    updated=names,
                    applied=True,
                    full_params=2_460_000,
                    val_accuracy=0.8,
                )
            )
            rounds.append(time.perf_counter() - began)
            began = time.perf_counter()
            json.dumps(state.snapshot())
            snapshots.append(time.perf_counter() - began)
        registry.close()
    return statistics.median(rounds), statistics.median(snapshots)


def _aggregation(global_state: dict[str, torch.Tensor], payloads: list) -> float:
    state = {k: v.clone() for k, v in global_state.items()}
    began = time.perf_counter()
    aggregate(state, payloads, inplace=True)
    return time.perf_counter() - began


def _phase(global_state: dict[str, torch.Tensor], payloads: list, repeats: int, seconds: float = 3.0) -> list[float]:
    """Aggregations back to back for at least ``repeats`` runs and ``seconds`` (long enough for the page to get events)."""
    times, end = [], time.monotonic() + seconds
    while len(times) < repeats or time.monotonic() < end:
        times.append(_aggregation(global_state, payloads))
    return times


class _Listener:
    """A client holding /api/events open and reading every event, as a browser's EventSource does."""

    def __init__(self, url: str) -> None:
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        with httpx.Client(timeout=None) as client, client.stream("GET", url + "api/events") as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.events += 1
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print(
        "Part 1: live-view bookkeeping per round, and one snapshot as the page gets it (median of",
        args.repeats,
        "rounds)",
    )
    print(f"{'devices':>8} {'per round':>12} {'per device':>12} {'snapshot+JSON':>14}")
    for devices in (4, 50, 200):
        per_round, snapshot = live_round_cost(devices, args.repeats)
        print(
            f"{devices:>8} {1e3 * per_round:>9.2f} ms {1e6 * per_round / devices:>9.1f} us {1e3 * snapshot:>11.2f} ms"
        )

    print("\nPart 2: the server's aggregation of a 5-client fmnist-small cohort, in the run thread")
    global_state, payloads = routed_cohort("fmnist-small", 5)
    state = DashboardState("federation", "bench")
    for i in range(4):
        state.set_device(f"device-{i}", budget_macs=10_000_000, online=True)
    times: dict[str, list[float]] = {
        "A: no dashboard": [],
        "B: dashboard, nobody connected": [],
        "C: dashboard, a browser connected": [],
    }
    ticking = threading.Event()

    def tick() -> None:  # device reports: 20 changes a second while a round runs
        i = 0
        while not ticking.is_set():
            state.set_device("device-0", last_seen=time.time(), rounds=i)
            i += 1
            time.sleep(0.05)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    events = 0
    try:
        for _ in range(3):  # A, B, C in turn, three times: drift of a shared machine hits all three alike
            times["A: no dashboard"] += _phase(global_state, payloads, args.repeats)
            dashboard = start_dashboard(state, "127.0.0.1:0")
            try:
                times["B: dashboard, nobody connected"] += _phase(global_state, payloads, args.repeats)
                listener = _Listener(dashboard.url)
                time.sleep(0.5)
                times["C: dashboard, a browser connected"] += _phase(global_state, payloads, args.repeats)
                listener.stop()
                events += listener.events
            finally:
                dashboard.stop()
    finally:
        ticking.set()
    base = statistics.median(times["A: no dashboard"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<36} {1e3 * median:8.2f} ms   x{median / base:.3f}")
    print(f"  events the connected client received: {events}")


if __name__ == "__main__":
    main()
