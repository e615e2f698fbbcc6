"""Cost of the robust aggregation rules against the method §6 mean, on the same routed cohort in one run (issue 9).

The cohort is bench_aggregate.py's: client i of m routes growing width and
depth, the last one the full supernet, with sample counts 50 + 40·i. Every
rule runs as the federation runs it: in place, into a fresh copy of the global
state made outside the timing, repetitions interleaved (mean, clip, ...,
mean, clip, ...) so drift hits every rule alike; the table shows the median.
``clip`` uses the adaptive bound (the cohort's median update norm), so about
half the cohort is scaled; ``trimmed-mean`` drops ⌊β·k⌋ of the k covering
values at each end (with β = 0.1 that is one per end only where all 10
clients cover a position; a tensor that fewer than 10 clients sent is averaged
without sorting). ``peak memory`` is how far a fresh process's peak RSS rises
above its resident size (Linux) while the rule aggregates the largest tensor alone (the coordinate-wise rules
work one tensor at a time, so this is their working set; the mean and clip
work in place).

    PYTHONPATH=. python3 bench/bench_robust.py [--preset fmnist-small paper-cifar100] [--clients 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

from feast_edge.aggregate.robust import robust_aggregate

RULES = {  # label -> (rule, keyword arguments)
    "mean (method §6)": ("mean", {}),
    "clip (adaptive)": ("clip", {}),
    "trimmed-mean β=0.1": ("trimmed-mean", {"trim": 0.1}),
    "median": ("median", {}),
}


def time_rules(global_state: dict[str, torch.Tensor], payloads: list, repeats: int) -> dict[str, float]:
    """Median seconds of each rule, in place into a fresh copy of the global state, interleaved."""
    samples: dict[str, list[float]] = {label: [] for label in RULES}
    for i in range(repeats + 1):  # the first pass warms up
        for label, (rule, kwargs) in RULES.items():
            target = {k: v.clone() for k, v in global_state.items()}
            start = time.perf_counter()
            robust_aggregate(target, payloads, rule, inplace=True, **kwargs)
            if i:
                samples[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in samples.items()}


def _peak_growth(args: tuple) -> float:
    """MiB the peak RSS of this process rises above its resident size while ``rule`` aggregates (Linux)."""
    global_state, payloads, rule, kwargs = args
    torch.set_num_threads(1)
    target = {k: v.clone() for k, v in global_state.items()}
    with open("/proc/self/clear_refs", "w") as refs:  # "5" resets the peak (VmHWM) to the current RSS
        refs.write("5")
    before = _status_kib("VmRSS:")
    robust_aggregate(target, payloads, rule, inplace=True, **kwargs)
    return (_status_kib("VmHWM:") - before) / 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def peak_memory(global_state: dict[str, torch.Tensor], payloads: list) -> dict[str, float]:
    """:func:`_peak_growth` of each rule on the largest tensor of the model, each in a new process."""
    name = max(global_state, key=lambda k: global_state[k].numel())
    one = ({name: global_state[name]}, [({name: state[name]}, n) for state, n in payloads if name in state])
    context = multiprocessing.get_context("spawn")
    out = {}
    for label, (rule, kwargs) in RULES.items():
        with context.Pool(1) as pool:
            out[label] = pool.apply(_peak_growth, ((*one, rule, kwargs),))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", default=["fmnist-small", "paper-cifar100"])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_aggregate import routed_cohort  # the cohort bench_aggregate.py times the mean on

    for preset in args.preset:
        global_state, payloads = routed_cohort(preset, args.clients)
        elements = sum(t.numel() for state, _ in payloads for t in state.values())
        largest = max(t.numel() for t in global_state.values())
        print(
            f"\npreset {preset}: global {sum(t.numel() for t in global_state.values()) / 1e6:.2f}M elements, {args.clients} routed payloads "
            f"= {elements / 1e6:.2f}M elements; largest tensor {largest / 1e6:.2f}M; torch threads {torch.get_num_threads()}; "
            f"median of {args.repeats}"
        )
        seconds = time_rules(global_state, payloads, args.repeats)
        memory = peak_memory(global_state, payloads)
        mean = seconds["mean (method §6)"]
        print(f"| {'rule':<20} | {'seconds':>8} | {'x mean':>7} | {'peak memory':>11} |")  # a Markdown table
        print(f"|{'-' * 22}|{'-' * 9}:|{'-' * 8}:|{'-' * 12}:|")
        for label, s in seconds.items():
            print(f"| {label:<20} | {s:8.3f} | {s / mean:6.1f}x | {memory[label]:7.0f} MiB |")


if __name__ == "__main__":
    main()
