"""Timing helpers for the bench scripts: interleaved repetitions, median seconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], object]], repeats: int = 20, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, alternating A, B, A, B ... so drift hits both alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def machine() -> str:
    """One line naming where a figure was measured: host, CPU model, torch version and its threads."""
    import platform
    from pathlib import Path

    import torch

    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor() or "?"
    )
    return f"{platform.node()}: {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def demo_arguments(doc: str):
    """The argument parser of a bench script that reads a finished ``feast-edge demo`` run: its directory, the
    Fashion-MNIST directory and ``--json``; the script adds its own options."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("demo", type=Path, help="a finished feast-edge demo run directory (its --out)")
    parser.add_argument("--data", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--json", type=Path, help="write the figures here too")
    return parser
