"""The server's work per release: a buffered asynchronous release against a synchronous round's aggregation of the
same updates (feast_edge.run.asynchronous).

    PYTHONPATH=. python3 bench/bench_async_release.py [--preset fmnist-small] [--buffer 10] [--threads 1]

K routed updates of growing width and depth (bench/bench_aggregate.py's cohort), half of them stale by 1 to 3
releases. Both sides aggregate into a fresh copy of the global state made outside the timing, through the same
release pipeline (feast_edge.run.release.Release, method §6):

    sync    the round's release of the K updates as sent (EveryRound: Release.apply)
    async   the buffer's release: each update weighed n·s(τ) (s = 1/sqrt(1+τ)) and released (Buffered.release)
    rebase  what the buffer did as each stale update arrived: w' = θ[routed] + Δ, in place of its delta (the
            buffer is released whole, so the model it is rebased on is the one the release starts from)

Only the work itself is timed (the copies of the state and of the kept deltas are made before). Median of
interleaved repetitions; prints the three, the release's ratio (target: async within 1.2× of sync) and the ratio
with the rebasing added.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import machine
from bench_aggregate import routed_cohort

from feast_edge.aggregate.sparse import aggregate
from feast_edge.run.asynchronous import Buffered
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.jobs import leading
from feast_edge.run.release import Release, RoundContext
from feast_edge.run.round_record import RoundRecord


class _Mean:
    """Method §6 as the loop's FEAST strategy runs it (in place)."""

    def aggregate(self, t, global_state, updates, plans) -> None:
        aggregate(global_state, [(u.state, u.samples) for u in updates], inplace=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--buffer", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global_state, payloads = routed_cohort(args.preset, args.buffer)
    updates = [ClientUpdate(f"c{i:02d}", state, n) for i, (state, n) in enumerate(payloads)]
    staleness = {u.client: (0 if i % 2 == 0 else 1 + i % 3) for i, u in enumerate(updates)}
    deltas = {u.client: {k: v - leading(global_state[k], v.shape) for k, v in u.state.items()} for u in updates}
    pipeline = Release(_Mean(), [])
    policy = Buffered(pipeline, "sqrt")

    def sync() -> float:
        state = {k: v.clone() for k, v in global_state.items()}
        began = time.perf_counter()
        pipeline.apply(RoundContext(0, len(updates), [], []), state, updates, {})
        return time.perf_counter() - began

    def rebase() -> tuple[float, list[ClientUpdate]]:
        """Each stale update rebased on the current model as it arrives (off the release's path)."""
        kept = {c: {k: v.clone() for k, v in d.items()} for c, d in deltas.items()}  # the kept deltas
        began = time.perf_counter()
        rebased = [
            u
            if not staleness[u.client]
            else ClientUpdate(
                u.client, {k: d.add_(leading(global_state[k], d.shape)) for k, d in kept[u.client].items()}, u.samples
            )
            for u in updates
        ]
        return time.perf_counter() - began, rebased

    def asynchronous() -> float:
        state = {k: v.clone() for k, v in global_state.items()}
        _, rebased = rebase()
        ctx = RoundContext(0, len(updates), [], [])
        ctx.record = RoundRecord(round=1, lr=0.1, cohort=[], staleness=staleness)
        began = time.perf_counter()
        policy.release(ctx, state, rebased, {}, None)
        return time.perf_counter() - began

    params = sum(sum(t.numel() for t in s.values()) for s, _ in payloads)
    samples: dict[str, list[float]] = {"sync": [], "async": [], "rebase": []}
    for repeat in range(args.repeats + 3):  # interleaved; the first 3 warm up
        for name, fn in (("sync", sync), ("async", asynchronous), ("rebase", lambda: rebase()[0])):
            seconds = fn()
            if repeat >= 3:
                samples[name].append(seconds)
    times = {name: statistics.median(values) for name, values in samples.items()}
    print(machine())
    print(
        f"{args.preset}: K = {args.buffer} routed updates ({params / 1e6:.1f} M values), "
        f"{sum(1 for s in staleness.values() if s)} stale"
    )
    print("| release | median ms |")
    print("|---|---:|")
    for name, seconds in times.items():
        print(f"| {name} | {1e3 * seconds:.1f} |")
    print(f"release: async / sync: {times['async'] / times['sync']:.2f}")
    print(
        f"with the rebasing on arrival: (async + rebase) / sync: {(times['async'] + times['rebase']) / times['sync']:.2f}"
    )


if __name__ == "__main__":
    main()
