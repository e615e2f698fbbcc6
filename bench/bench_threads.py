"""Threads on a shared machine: the co-training step beside busy processes at 1 thread, every core and the adaptive
choice; and how much a device's own application slows down beside the agent at normal and at lowered priority.

    python bench/bench_threads.py [--preset fmnist-small] [--batch 64] [--steps 3] [--blocks 8] [--seconds 12]
                                  [--pairs 3] [--part both|steps|foreground]

Part 1, the step. For 0, 1 and 2 competing processes (a Python loop each, normal
priority, started before the row and running through it), the co-training step of
``bench_cotrain.py`` (a_max, a_min, a_rand with KD, float32) is timed in blocks of
``--steps`` steps, the three settings taking turns: ``--threads 1``, every core of
the affinity mask, and the adaptive choice (``feast_edge.util.cores.Threads``, made
again before each block as the agent makes it before each round). Prints the
median step per setting, the adaptive count chosen and its ratio to the better
fixed setting (target <= 1.15).

Part 2, the foreground. A device's own application is a process that runs a small
network's batch-1 inference on one thread in a loop. Its rate is measured alone,
then beside the agent's training in another process (co-training steps without
end, its threads chosen again between steps every 2 s, as ``feast-agent run`` does) at the adaptive choice and at
every core, each at niceness 0 and at ``feast-agent run``'s default 10; ``--pairs``
such pairs per setting. Prints the application's slowdown (rate alone / rate
beside the agent, median of the pairs) and the agent's own step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cotrain import batch_for, bench_variants  # noqa: E402

from feast_edge.local.cotrain import ShapeCache, cotrain_step, make_optimizer  # noqa: E402
from feast_edge.local.recipe import TrainConfig  # noqa: E402
from feast_edge.space.arch import Arch  # noqa: E402
from feast_edge.space.extract import extract  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402
from feast_edge.util.cores import Threads, affinity_cpus  # noqa: E402

SPIN = "while True: pass"


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.kill()
    for p in processes:
        p.wait(10)


def training_step(preset_name: str, batch_size: int):
    """One co-training step of bench_cotrain, as a function."""
    preset, config = load_preset(preset_name), TrainConfig()
    variants = bench_variants(preset)
    batch = batch_for(preset, batch_size)
    model = Supernet(preset, seed=0).train()
    opt, shapes = make_optimizer(model, config, config.lr), ShapeCache(model)
    plan = [("max", variants["max"]), ("min", variants["min"]), ("rand", variants["rand"])]
    return lambda: cotrain_step(model, opt, batch, plan, config, shapes)


def time_block(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def part_steps(args: argparse.Namespace) -> None:
    cores = len(affinity_cpus())
    step = training_step(args.preset, args.batch)
    for _ in range(3):
        step()  # warm-up
    print(f"\nthe co-training step ({args.preset}, batch {args.batch}, float32), median ms; {cores} cores")
    print(f"{'competing busy processes':>25} | {'--threads 1':>11} | {f'all ({cores})':>11} | {'adaptive':>15} | ratio")
    adaptive = Threads(0)
    try:
        for load in (0, 1, 2):
            competitors = spinners(load)
            try:
                time.sleep(3.5)  # the monitor's window sees them
                samples: dict[str, list[float]] = {"1": [], "all": [], "adaptive": []}
                chosen = []
                for _ in range(args.blocks):
                    for name in samples:
                        if name == "adaptive":
                            chosen.append(adaptive.use("training"))
                        else:
                            torch.set_num_threads(1 if name == "1" else cores)
                        samples[name] += time_block(step, args.steps)
            finally:
                stop(competitors)
            ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
            best = min(ms["1"], ms["all"])
            picks = "/".join(str(c) for c in sorted(set(chosen)))
            print(
                f"{load:>25} | {ms['1']:>11.1f} | {ms['all']:>11.1f} | {ms['adaptive']:>9.1f} ({picks} t) | "
                f"{ms['adaptive'] / best:.2f}"
            )
    finally:
        adaptive.close()
    print("ratio: adaptive / the better fixed setting of the row (target <= 1.15)")


# --- part 2: the device's own application beside the agent -----------------------------------------------------------
def foreground(seconds: float) -> None:
    """The application: batch-1 inference of the smallest fmnist-small variant on one thread; prints inferences/s."""
    torch.set_num_threads(1)
    preset = load_preset("fmnist-small")
    model = extract(Supernet(preset, seed=0), Arch.smallest(preset)).eval()
    x = torch.rand(1, 1, 28, 28)
    with torch.inference_mode():
        for _ in range(20):
            model(x)
        done, start, began = 0, time.perf_counter(), time.time()
        while time.perf_counter() - start < seconds:
            model(x)
            done += 1
    print(done / (time.perf_counter() - start), began, time.time())


def agent(preset: str, batch: int, threads: int, nice: int) -> None:
    """The agent's training: co-training steps without end at niceness ``nice``; prints each step's end (wall clock)
    and seconds."""
    from feast_edge.util.priority import lower_priority

    lower_priority(nice)
    policy = Threads(threads)
    step = training_step(preset, batch)
    policy.use("training")
    while True:  # as feast-agent run trains: the threads chosen again between steps, every 2 s (Threads.refresh)
        start = time.perf_counter()
        step()
        print(time.time(), time.perf_counter() - start, flush=True)
        policy.refresh("training")


def run_foreground(seconds: float) -> tuple[float, float, float]:
    """The application's inferences/s, and the wall-clock times its timed loop began and ended."""
    out = subprocess.run(
        [sys.executable, __file__, "--foreground", str(seconds)], capture_output=True, text=True, check=True
    )
    rate, began, ended = map(float, out.stdout.strip().splitlines()[-1].split())
    return rate, began, ended


def beside_agent(args: argparse.Namespace, threads: int, nice: int) -> tuple[float, float, float]:
    """The application's rate alone, then beside an agent training at ``threads`` (0: adaptive) and niceness ``nice``;
    and the agent's median step while the application ran (seconds)."""
    alone = run_foreground(args.seconds)[0]  # just before: a 2-core VM's own speed drifts from minute to minute
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-threads-agent-{os.getpid()}.txt"
    with open(log, "w") as sink:
        trainer = subprocess.Popen(
            [sys.executable, __file__, "--agent", str(threads), str(nice), "--preset", args.preset],
            stdout=sink,
            stderr=subprocess.DEVNULL,
        )
    try:
        time.sleep(8.0)  # its data and model are ready, its first steps taken
        rate, began, ended = run_foreground(args.seconds)
    finally:
        trainer.kill()
        trainer.wait(10)
    rows = [line.split() for line in log.read_text().splitlines() if len(line.split()) == 2]
    log.unlink(missing_ok=True)
    # The agent's steps that ran while the application did (its start-up and warm-up are not the agent's pace).
    steps = [float(s) for end, s in rows if began <= float(end) - float(s) and float(end) <= ended]
    return alone, rate, statistics.median(steps) if steps else float("nan")


def part_foreground(args: argparse.Namespace) -> None:
    cores = len(affinity_cpus())
    print(f"\na device's own application (batch-1 inference, one thread) beside the agent's training; {cores} cores")
    print(f"{'agent threads':>14} | {'agent nice':>10} | {'app alone /s':>12} | {'app beside /s':>13} | "
          f"{'app slowdown':>12} | {'agent step ms':>13}")  # fmt: skip
    for threads, label in ((0, "adaptive"), (cores, f"all ({cores})")):
        for nice in (0, 10):
            runs = [beside_agent(args, threads, nice) for _ in range(args.pairs)]
            alone = statistics.median(r[0] for r in runs)
            rate = statistics.median(r[1] for r in runs)
            slowdown = statistics.median(r[0] / r[1] for r in runs)
            step_ms = statistics.median(r[2] for r in runs) * 1e3
            print(f"{label:>14} | {nice:>10} | {alone:>12.0f} | {rate:>13.0f} | {slowdown:>11.2f}x | {step_ms:>13.1f}")
    print(
        "app slowdown: the application's inferences/s just before the agent started / beside it, median of "
        f"{args.pairs} pairs (1.00x: not slowed); agent step: the median of its steps while the application ran"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per setting and row, the settings taking turns")
    parser.add_argument("--seconds", type=float, default=12.0, help="how long the application runs each time")
    parser.add_argument("--pairs", type=int, default=3, help="alone/beside pairs per setting")
    parser.add_argument("--part", choices=("both", "steps", "foreground"), default="both", help="which part to run")
    parser.add_argument("--foreground", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--agent", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.foreground is not None:
        return foreground(args.foreground)
    if args.agent is not None:
        return agent(args.preset, args.batch, *args.agent)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; affinity {len(affinity_cpus())} cores")
    if args.part in ("both", "steps"):
        part_steps(args)
    if args.part in ("both", "foreground"):
        part_foreground(args)


if __name__ == "__main__":
    main()
