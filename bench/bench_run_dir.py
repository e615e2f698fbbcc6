"""A run directory after a thousand rounds without an end: its size with the retention policy against the full history.

    python bench/bench_run_dir.py [--rounds 1000] [--marks 250,500,1000] [--threads 1] [--work DIR]

One ``--continuous`` simulation validated by its devices (the richest round records: each device's served-variant
counts, flagged devices, the served round's reason), tiny so that a thousand rounds take minutes: fmnist-tiny, 4
clients, 2 per round, 50 training images each, validated every 5 rounds, ``--holdout 0.2``. At each mark the run
directory's files are measured, and beside them what the checkpoint's history would weigh if every round were kept in
full (each round's record as it was written, kept aside in this process, as JSON). The policy
(feast_edge.run.retention): the last 50 rounds in full, older ones compact.

Prints a line per mark and writes a record to bench/results/ (bench/_records.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _records import write_record

from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.run.checkpoint import read_record
from feast_edge.sim.config import SimulationConfig
from feast_edge.sim.simulate import Simulation


def sizes(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--marks", default="250,500,1000")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.work or tempfile.mkdtemp(prefix="bench-run-dir-")) / "run"
    marks = [int(m) for m in args.marks.split(",")]
    config = SimulationConfig.of(
        data_dir=str(FASHION_MNIST_DIR), preset=str(REPO / "tests" / "presets" / "fmnist-tiny.toml"), clients=4, per_round=2, train_limit=400,
        test_limit=200, val_samples=200, calib_samples=64, eval_every=5, seed=0, device="cpu", batch_size=16,
        rounds=args.rounds, continuous=True, validate_on="devices", holdout=0.2,
    )  # fmt: skip
    full: list[dict] = []
    figures: dict = {"marks": {}}
    began = time.monotonic()
    sim = Simulation(config, out)

    def keep(record) -> None:
        full.append(copy.deepcopy(asdict(record)))
        n = record.round
        if n in marks:
            on_disk = sizes(out)
            header = len(json.dumps(read_record(out / "checkpoint.safetensors")["fields"]["history"]))
            whole = len(json.dumps(full))
            figures["marks"][str(n)] = {
                "files": on_disk,
                "directory_bytes": sum(on_disk.values()),
                "history_bytes_kept": header,
                "history_bytes_full": whole,
                "seconds": time.monotonic() - began,
            }
            print(f"round {n}: directory {sum(on_disk.values()) / 1e6:.2f} MB ({', '.join(f'{k} {v / 1e6:.2f}' for k, v in on_disk.items())}); "
                  f"history in the checkpoint {header / 1e3:.0f} kB kept, {whole / 1e3:.0f} kB in full; "
                  f"{time.monotonic() - began:.0f} s", flush=True)  # fmt: skip

    sim.run(on_record=keep)
    model_bytes = (
        os.path.getsize(out / "checkpoint.safetensors") - figures["marks"][str(marks[-1])]["history_bytes_kept"]
    )
    figures["model_and_state_bytes_about"] = model_bytes
    print(f"record: {write_record('run-dir', {**figures, 'settings': vars(args)})}")


if __name__ == "__main__":
    main()
