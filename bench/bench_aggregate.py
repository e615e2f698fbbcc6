"""Sparse aggregation of one routed cohort vs a dense ``torch.add_`` over the same elements (method §6).

Clients get growing envelopes: client i of m routes width index round(9·i/(m-1))
for the stem and every stage and depth round(d_max·i/(m-1)) in every stage, so
the last client routes the full supernet. Both sides accumulate the same number
of float32 payload elements; the sparse side (``aggregate``, payloads in the
order given) also keeps counts, maps each tensor to its leading slice and
produces the new global state. It is timed as the federation runs it (in place,
into a fresh copy of the global state made outside the timing), into newly
allocated tensors, and on the general sums-and-counts path (payloads streamed
smallest first). A second dense reference adds what any average needs besides
the adds (zero the sums, one divide over the model).

    PYTHONPATH=. python3 bench/bench_aggregate.py [--preset paper-cifar100] [--clients 10] [--threads 1]

One intra-op thread by default: on a small shared machine every parallel
region can stall for a scheduler tick, which swamps the per-tensor calls of the
sparse side (the dense side makes one call per client).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from feast_edge.aggregate.sparse import SparseAccumulator, aggregate
from feast_edge.space.geometry import envelope_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet


def routed_cohort(
    preset_name: str, clients: int
) -> tuple[dict[str, torch.Tensor], list[tuple[dict[str, torch.Tensor], int]]]:
    """Global state and ``clients`` routed payloads of growing width and depth, with sample counts."""
    preset = load_preset(preset_name)
    top_w = len(preset.width_multipliers) - 1
    global_state = Supernet(preset, seed=0).state_dict()
    payloads = []
    for i in range(clients):
        frac = i / max(1, clients - 1)
        w, d = round(top_w * frac), round(preset.max_extra_blocks * frac)
        n = preset.num_stages
        layout = envelope_layout(preset, preset.classes, w, (d,) * n, (w,) * n)
        payloads.append((Supernet(preset, layout=layout, seed=i + 1).state_dict(), 50 + 40 * i))
    return global_state, payloads


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    """Smallest wall time of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-cifar100")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    global_state, payloads = routed_cohort(args.preset, args.clients)
    sizes = [sum(t.numel() for t in state.values()) for state, _ in payloads]
    total = sum(sizes)
    flat = [torch.cat([t.reshape(-1).float() for t in state.values()]) for state, _ in payloads]
    print(
        f"preset {args.preset}: global {sum(t.numel() for t in global_state.values()) / 1e6:.2f}M elements, "
        f"{args.clients} routed payloads {', '.join(f'{s / 1e6:.2f}M' for s in sizes)} = {total / 1e6:.2f}M elements; "
        f"torch threads {torch.get_num_threads()}"
    )

    n_global = sum(t.numel() for t in global_state.values())
    for dtype in (torch.float32, torch.float64):
        dst = torch.zeros(n_global, dtype=dtype)
        scratch = torch.empty(max(sizes), dtype=dtype)

        def as_dtype(src: torch.Tensor) -> torch.Tensor:
            # copy_ then same-dtype add_: a mixed fp64 += fp32 add_ takes a much slower path.
            return src if src.dtype == dtype else scratch[: src.numel()].copy_(src)

        def dense_add() -> None:
            for src in flat:
                dst[: src.numel()].add_(as_dtype(src), alpha=2.0)

        def dense_fedavg() -> None:
            # The same adds plus what any average must also do: zero the sums, divide once.
            dst.zero_()
            dense_add()
            dst.div_(3.0)

        def timed_sparse(inplace: bool) -> float:
            target = {k: v.clone() for k, v in global_state.items()} if inplace else global_state
            start = time.perf_counter()
            aggregate(target, payloads, dtype, inplace=inplace)
            return time.perf_counter() - start

        def sparse_general() -> None:
            # Smallest payload first: every box sticks out of its predecessor, so every tensor
            # takes the general path (explicit sums, count grid, final division).
            acc = SparseAccumulator(global_state, dtype)
            for state, n in payloads:
                acc.add(state, n)
            acc.result()

        dense_add(), timed_sparse(True)  # warm up
        t_add = best_of(args.repeats, dense_add)
        t_avg = best_of(args.repeats, dense_fedavg)
        t_inplace = min(timed_sparse(True) for _ in range(args.repeats))
        t_new = min(timed_sparse(False) for _ in range(args.repeats))
        t_general = best_of(args.repeats, sparse_general)
        name = str(dtype).removeprefix("torch.")
        print(
            f"[{name} accumulator] dense add_ {t_add:.3f} s | sparse in place (as the federation runs it) "
            f"{t_inplace:.3f} s -> ratio {t_inplace / t_add:.2f}x (target <= 2x) | into new tensors {t_new:.3f} s "
            f"-> {t_new / t_add:.2f}x | general path (sums+counts, new tensors) {t_general:.3f} s -> "
            f"{t_general / t_add:.2f}x | dense zero+add_+div {t_avg:.3f} s"
        )


if __name__ == "__main__":
    main()
