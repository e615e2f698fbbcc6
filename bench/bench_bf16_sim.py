"""float32 vs bfloat16-autocast local training in the research protocol: time and accuracy, same seeds, side by side.

    PYTHONPATH=. python bench/bench_bf16_sim.py [--rounds 5] [--seeds 0 1] [--out /tmp/bf16-sim] [--threads 2]

One ``feast-edge simulate`` per seed and ``--amp`` (off, bf16) on the paper's γ = 1 Zipf population of fmnist-small
(10 clients, 5 per round, 8,000 training examples split in proportion to the budgets; test on 2,000 images). Prints
each run's wall time, population accuracy and largest-variant accuracy, and per seed the bf16 − float32 accuracy
differences and the time ratio. Whether bf16 is *fast* depends on the CPU: it says whether this one has native
bfloat16 (feast_edge.local.precision.cpu_has_native_bf16); without, PyTorch emulates it and the ratio shows that
cost, not what an AVX512-BF16/AMX or Arm-BF16 CPU gains.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from feast_edge.local.precision import _native_bf16_from_cpuinfo, cpu_has_native_bf16

POPULATION = ["--clients", "10", "--per-round", "5", "--gamma", "1", "--train-limit", "8000"]
EVALUATION = ["--val-samples", "1000", "--calib-samples", "200", "--test-limit", "2000"]


def simulate(out: Path, seed: int, amp: str, rounds: int, threads: int) -> dict:
    run = out / f"seed{seed}-{amp}"
    wall = run / "wall_seconds.txt"
    if not (run / "results.json").is_file():
        command = [sys.executable, "-m", "feast_edge.cli", "simulate", "--out", str(run), "--seed", str(seed)]
        command += ["--rounds", str(rounds), "--eval-every", str(rounds), "--threads", str(threads), "--amp", amp]
        command += ["--device", "cpu", *POPULATION, *EVALUATION]
        began = time.monotonic()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall.write_text(f"{time.monotonic() - began:.1f}\n")
    results = json.loads((run / "results.json").read_text())
    largest = max(results["variants"], key=lambda v: v["macs"])
    return {
        "population": results["population_accuracy"],
        "largest": largest["test_accuracy"],
        "seconds": float(wall.read_text()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bf16-sim"))
    args = parser.parse_args()
    try:
        flag = _native_bf16_from_cpuinfo(Path("/proc/cpuinfo").read_text(), __import__("platform").machine())
    except OSError:
        flag = None
    print(f"native bfloat16 on this CPU: {cpu_has_native_bf16()} ({flag or 'no avx512_bf16/amx_bf16/bf16 flag'})")
    print("| seed | --amp | wall time | population acc | largest variant acc |")
    print("|---:|---|---:|---:|---:|")
    rows = {}
    for seed in args.seeds:
        for amp in ("off", "bf16"):  # interleaved by seed: drift on the machine hits both
            r = rows[seed, amp] = simulate(args.out, seed, amp, args.rounds, args.threads)
            print(
                f"| {seed} | {amp} | {r['seconds']:.0f} s | {100 * r['population']:.2f} % | {100 * r['largest']:.2f} % |",
                flush=True,
            )
    print("\n| seed | Δ population (bf16 − fp32) | Δ largest | time bf16 / fp32 |")
    print("|---:|---:|---:|---:|")
    for seed in args.seeds:
        a, b = rows[seed, "off"], rows[seed, "bf16"]
        print(
            f"| {seed} | {100 * (b['population'] - a['population']):+.2f} | {100 * (b['largest'] - a['largest']):+.2f} "
            f"| {b['seconds'] / a['seconds']:.2f}x |"
        )


if __name__ == "__main__":
    main()
