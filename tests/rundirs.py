"""Run directories written by tests: a ``feast-server run --out`` directory (its checkpoint, registry and exported
models) and synthetic ``feast-edge simulate`` results.json files.

``federated=True``: a server without ``--data`` (validation on the devices' held-out splits, the model of pi-5
calibrated on pi-5, which reported its held-out accuracy); ``federated=False``: the server's ``--data``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from feast_edge.run.checkpoint import save_supernet
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT
from feast_edge.server.registry import Registry
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet

ARCH = {"d": [0, 0, 0], "e": [0.5, 0.5, 0.5], "w": [0, 0, 0, 0]}
DEVICES = ("cam-1", "pi-5")
HELD_OUT = 60  # examples the cohort held out, in all (the federated run's validation)
HOLDOUT_ACCURACY = 0.875  # what pi-5 reported of the model it calibrated


def federation_run(out: Path, preset: Preset, *, federated: bool) -> Path:
    """A checkpoint with 2 of 3 rounds (both validated), the registry of cam-1 and pi-5, pi-5's exported model."""
    out.mkdir()
    history = [
        {
            "round": r,
            "lr": 0.1,
            "cohort": list(DEVICES),
            "updated": list(DEVICES) if r == 1 else ["pi-5"],
            "rejected": {} if r == 1 else {"cam-1": "bad digest"},
            "loss": 1.5,
            "routed_params": 1000,
            "full_params": 5000,
            "train_macs": 10**9,
            "seconds": 3.0,
            "val_accuracy": 0.2 * r,
            "validation": {
                "source": "devices",
                "devices": list(DEVICES),
                "missing": [],
                "samples": HELD_OUT,
                "points": {"variant 0": 0.2 * r},
                "seconds": 1.0,
            }
            if federated
            else {},
        }
        for r in (1, 2)
    ]
    config = {"federation": "lab", "preset": preset.name, "rounds": 3, "method": "feast", "seed": 7}
    save_supernet(
        out / CHECKPOINT,
        Supernet(preset, seed=0),
        kind="federation",
        fingerprint="x",
        config=config,
        round=2,
        history=history,
        history_format=HISTORY_FORMAT,
        best={"round": 2, "val_accuracy": 0.4},
        data=None if federated else "/data/fashion-mnist",
        registry=[],
    )
    registry = Registry(out / "devices.sqlite")
    for name, budget in (("cam-1", 2_000_000), ("pi-5", 6_000_000)):
        registry.register(
            name,
            host="agent-1",
            instance="i",
            budget_macs=budget,
            samples=100,
            preset=preset.name,
            profile={"name": "raspberry-pi-5", "hardware": {"cpu": "4x Cortex-A76"}},
            status="online",
        )
    models = out / "models"
    models.mkdir()
    manifest = {
        "device": "pi-5",
        "arch": ARCH,
        "macs": 1_230_000,
        "params": 45,
        "rounds": 2,
        "sha256": "cd" * 32,
        "size": 4,
    }
    if federated:
        (models / "pi-5.variant.safetensors").write_bytes(b"wts!")
        manifest.update(file="pi-5.variant.safetensors", calibration="device", bn_recalibrated=False)
        registry.touch(
            "pi-5",
            metrics={
                "holdout_accuracy": HOLDOUT_ACCURACY,
                "holdout_samples": 40,
                "calibrated_on": 200,
                "model_sha256": "ef" * 32,
                "model_macs": 1_230_000,
                "model_round": 2,
            },
        )
    else:
        (models / "pi-5.onnx").write_bytes(b"onnx")
        manifest.update(file="pi-5.onnx", validation_accuracy=0.4, bn_recalibrated=True)
    registry.close()
    (models / "index.json").write_text(json.dumps({"models": [manifest]}))
    return out


# ------------------------------------------------------------------ synthetic simulate runs
BUDGETS = [12e6, 25e6, 50e6, 50e6]
# label -> (MACs, params) of the cached variants FEAST and the centralized reference share
CACHED = {"v0": (10_000_000, 100_000), "v1": (20_000_000, 200_000), "v2": (40_000_000, 400_000)}
HETEROFL = {
    "x0.125": (5_000_000, 50_000),
    "x0.25": (15_000_000, 150_000),
    "x0.5": (30_000_000, 300_000),
    "x1": (45_000_000, 450_000),
}


def simulate_results(
    method: str,
    seed: int,
    accuracies: dict[str, float],
    points: dict[str, tuple[int, int]],
    *,
    population: float,
    **extra: Any,
) -> dict[str, Any]:
    """A results.json of ``simulate``: 4 rounds, validated on rounds 2 and 4."""
    config = {
        "seed": seed,
        "rounds": 4,
        "clients": len(BUDGETS),
        "per_round": 2,
        "variants": "full",
        "method_options": [],
        **extra.pop("config", {}),
    }
    variants = [
        {
            "index": i,
            "label": label,
            "macs": points[label][0],
            "params": points[label][1],
            "dense_macs": None,
            "detail": {},
            "test_accuracy": accuracies[label],
        }
        for i, label in enumerate(accuracies)
    ]
    rounds = [
        {
            "round": t,
            "lr": 0.02,
            "loss": 2.0 / t,
            "samples": 100,
            "train_macs": 10**12,
            "routed_params": 1_000_000,
            "val_accuracy": None if t % 2 else 0.1 * t + 0.01 * seed,
            "seconds": 2.5,
        }
        for t in range(1, 5)
    ]
    return {
        "method": method,
        "method_summary": f"{method} (synthetic)",
        "preset": "fmnist-small",
        "config": config,
        "best": {"round": 4, "val_accuracy": 0.4 + 0.01 * seed},
        "population": {"budgets": extra.pop("budgets", BUDGETS), "clients": len(BUDGETS)},
        "population_accuracy": population,
        "variants": variants,
        "served": [0, 1, 2, 2],
        "communication": {"routed_params_total": 8_000_000, "full_params_total": 16_000_000, "reduction": 2.0},
        "compute": {"train_macs_total": 4 * 10**12},
        "rounds": rounds,
        "seconds_total": 10.0,
        **extra,
    }


def write_run(folder: Path, record: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(record))
    return folder
