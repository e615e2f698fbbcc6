"""Benchmark results as data: one JSON record per run of a bench script (command, CPU, date, commit, figures).

    write_record("served-demo", figures)  ->  bench/results/served-demo-2026-12-07-<commit>.json

The docs show what a record means; the record keeps what was measured, where and on which code, so a figure in the
docs can always be traced to the run that made it. Its tables are declared in bench/tables/ (bench/_tables.py) and
rendered into docs/benchmarks.md by ``python -m docs_hooks.bench_tables``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def cpu() -> dict[str, Any]:
    """What lscpu says of this CPU (vendor, model name, family, model, flags of note) and the cores."""
    fields: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = set(fields.get("Flags", "").split())
    return {
        "vendor": fields.get("Vendor ID", "?"),
        "model_name": fields.get("Model name") or platform.processor() or "?",
        "family": fields.get("CPU family", "?"),
        "model": fields.get("Model", "?"),
        "avx512": "avx512f" in flags,
        "amx": "amx_tile" in flags,
        "cores": os.cpu_count(),
        "hypervisor": fields.get("Hypervisor vendor"),
    }


def commit() -> str:
    """The checked-out commit (with ``+changes`` when the tree differs from it)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], check=False, cwd=REPO, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], check=False, cwd=REPO, capture_output=True
        )
    except OSError:
        return "?"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


STARTED_ON = commit()  # the code a bench script runs: read when it imports this module, before anything can change


def write_record(name: str, figures: dict[str, Any]) -> Path:
    """``figures`` with the command, CPU, date and the commit the run started on, as
    ``bench/results/<name>-<date>-<commit>.json``."""
    import torch

    now = datetime.datetime.now()
    today = now.date().isoformat()
    record = {
        "benchmark": name,
        "command": " ".join(shlex.quote(a) for a in ["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "date": today,
        "time": now.strftime("%H:%M:%S"),  # the newest of a day's records is the one the docs' tables show
        "commit": STARTED_ON,
        "cpu": cpu(),
        "torch": torch.__version__,
        "figures": figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{today}-{record['commit'].split('+')[0]}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path
